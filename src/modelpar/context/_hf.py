"""Hugging Face models under context parallelism, through transformers' attention-function registry.

:func:`use_context_parallel_attention` gives each attention module a :class:`ContextParallelAttention` and
switches the model to the ``"modelpar_context_parallel"`` attention implementation, registered with
``transformers.AttentionInterface`` (the kernel) and ``AttentionMaskInterface`` (the mask). The mask HF would
build from local shapes means nothing under context parallelism, so the registered mask function passes the
model's 2-D ``attention_mask`` through untouched: call the model with the *whole* padding mask, in global order,
as ``shard_batch`` leaves it, next to the local ``input_ids`` and their global ``position_ids``::

    batch = shard_batch(batch, mesh, shift_labels=True)
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   attention_mask=batch.get("attention_mask"), use_cache=False).logits
    loss = cross_entropy(logits, batch["labels"], mesh)   # not the model's own (shifting) loss

The kernel then receives that mask as ``key_padding_mask``. Packed sequences (position ids restarting inside a
row) are not supported: the whole row is one causal sequence.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from modelpar.context._attention import ContextParallelAttention
from modelpar.context._layout import context_mesh

__all__ = ["ATTENTION_NAME", "KERNEL_ATTRIBUTE", "use_context_parallel_attention"]

#: The name the kernel and its mask function are registered under in transformers.
ATTENTION_NAME = "modelpar_context_parallel"

#: The attribute of each attention module holding its :class:`ContextParallelAttention`.
KERNEL_ATTRIBUTE = "context_parallel_attention"


def _hf_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the module's kernel; returns ``(batch, seq, heads, dim)``."""
    kernel = getattr(module, KERNEL_ATTRIBUTE, None)
    if not isinstance(kernel, ContextParallelAttention):
        raise NotImplementedError(
            f"{type(module).__name__} runs the {ATTENTION_NAME!r} attention but has no context-parallel kernel"
            f" (`{KERNEL_ATTRIBUTE}`). Call `modelpar.context.use_context_parallel_attention(model, device_mesh)`"
            " on the whole model rather than setting the attention implementation by name."
        )
    if dropout:
        raise NotImplementedError(
            f"Attention dropout ({dropout}) is not supported under context parallelism. Set the config's"
            " `attention_dropout=0.0`."
        )
    if softcap is not None or kwargs.get("is_causal", getattr(module, "is_causal", True)) is False:
        raise NotImplementedError(
            f"{type(module).__name__} asks for soft-capped or non-causal attention, but the context-parallel kernel"
            " computes plain causal attention only."
        )
    if sliding_window is not None and sliding_window < _global_length(query, kernel):
        raise NotImplementedError(
            f"{type(module).__name__} uses sliding-window attention (window {sliding_window}) on a sequence of"
            f" {_global_length(query, kernel)} tokens, which the context-parallel kernel does not support. Use"
            f" sequences of at most {sliding_window} tokens, or a model with full attention."
        )
    if attention_mask is not None and not (isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2):
        shape = tuple(attention_mask.shape) if hasattr(attention_mask, "shape") else type(attention_mask).__name__
        raise ValueError(
            f"The attention mask reaching the context-parallel kernel is {shape}, but only a 2-D padding mask"
            " (batch, global seq) can be honoured. Pass `attention_mask` as `shard_batch` leaves it (whole, 2-D)."
        )
    padding = None if attention_mask is None else attention_mask.bool()
    out = kernel(query, key, value, scale=scaling, key_padding_mask=padding)
    return out.transpose(1, 2).contiguous(), None


def _global_length(query: torch.Tensor, kernel: ContextParallelAttention) -> int:
    mesh = context_mesh(kernel.device_mesh)
    return query.shape[2] * (1 if mesh is None else mesh.size())


def _hf_mask(*, attention_mask: torch.Tensor | None = None, **_: Any) -> torch.Tensor | None:
    """The mask "creation" for the kernel: the model's 2-D padding mask (global), untouched, or ``None``."""
    return attention_mask


def _check_config(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(model, "set_attn_implementation"):
        raise NotImplementedError(
            f"{name} is not a transformers model (no `config` / `set_attn_implementation`). For your own model,"
            " call `modelpar.context.ContextParallelAttention(device_mesh)` from its attention modules."
        )
    if not getattr(model, "_supports_attention_backend", False):
        raise NotImplementedError(
            f"{name} does not dispatch attention through transformers' attention interface"
            " (`_supports_attention_backend` is False), so its attention cannot be replaced for context parallelism."
        )
    if getattr(config, "is_causal", True) is False or getattr(config, "is_encoder_decoder", False):
        raise NotImplementedError(f"{name} has non-causal attention; context parallelism supports causal LMs only.")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise NotImplementedError(
            f"{name} soft-caps its attention logits (`attn_logit_softcapping={config.attn_logit_softcapping}`),"
            " which the context-parallel kernel does not support."
        )
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds - {"full_attention"}:
        raise NotImplementedError(
            f"{name} has layers of types {sorted(kinds)}, but context parallelism supports full (causal) attention"
            ' only: every entry of `config.layer_types` must be "full_attention".'
        )


def use_context_parallel_attention(model: nn.Module, device_mesh: DeviceMesh) -> None:
    """Make ``model`` (a transformers causal LM) compute attention across the context-parallel ranks.

    Checks the model first (``NotImplementedError`` for one whose attention cannot be replaced: no attention
    interface, sliding-window layer types, soft-capping, non-causal), then gives every attention module (those
    with ``num_key_value_groups``) a kernel for ``device_mesh`` and selects it. Call it before or after sharding.
    """
    _check_config(model)
    kernel = ContextParallelAttention(device_mesh)
    modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups") and hasattr(m, "is_causal")]
    if not modules:
        raise NotImplementedError(
            f"No attention module of {type(model).__name__} has the attributes transformers' attention modules"
            " have (`num_key_value_groups`, `is_causal`), so none can take the context-parallel kernel."
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, _hf_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _hf_mask)
    for module in modules:
        setattr(module, KERNEL_ATTRIBUTE, kernel)
    model.set_attn_implementation(ATTENTION_NAME)  # type: ignore[operator]
