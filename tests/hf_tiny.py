"""The tiny Hugging Face model every HF test builds: heads and vocabulary divisible by tensor-parallel sizes 2 and 4."""

from __future__ import annotations

from typing import Any

#: Sizes shared by every family's config (Llama, Qwen2, Qwen3, Mistral): small enough for CPU processes.
TINY_SIZES: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


def tiny_config(**overrides: Any) -> Any:
    """A ``LlamaConfig`` of :data:`TINY_SIZES`, with ``overrides`` applied."""
    from transformers import LlamaConfig

    return LlamaConfig(**{**TINY_SIZES, **overrides})
