"""Small reference models with the module names our ready-made plans expect (examples, tests, benchmarks)."""

from modelpar.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
