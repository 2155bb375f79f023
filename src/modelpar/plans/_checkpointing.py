"""Activation checkpointing of a module in place, with public torch APIs and without a wrapper module.

The module's ``forward`` is replaced (on the instance) by one that runs the original under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. No wrapper module is inserted, so parameter
and state-dict names stay exactly what they were (no ``_checkpoint_wrapped_module`` segment), and
``fully_shard`` applied afterwards puts its hooks *outside* the recomputed region, as with torchtitan's
wrapper: parameters are all-gathered once for backward and the recomputation uses them.
"""

from __future__ import annotations

import sys
from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "checkpoint_module", "is_checkpointed"]

_aten = torch.ops.aten
#: What ``"selective"`` keeps from forward: the outputs of matrix multiplies (float8 ones included) and attention;
#: everything else in the unit (norms, activations, rotary embeddings, elementwise ops) is recomputed.
SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
        "_scaled_mm",  # float8 layers' multiplies (modelpar.float8)
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
    )
    if hasattr(_aten, name)
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


class _CheckpointedForward:
    """The module's own ``forward``, run under non-reentrant activation checkpointing."""

    def __init__(self, forward: Any, selective: bool, reads_cache_only: bool = False) -> None:
        self.forward = forward
        self.selective = selective
        self.reads_cache_only = reads_cache_only

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            args, kwargs = _without_kv_cache(args, kwargs, keep=self.reads_cache_only)
        if self.selective:
            context_fn = partial(create_selective_checkpoint_contexts, _policy)
            return checkpoint(self.forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def _is_kv_cache(value: Any) -> bool:
    """Whether ``value`` is a Hugging Face key/value cache (any ``transformers.cache_utils.Cache``).

    Read from ``sys.modules``: a cache object exists only once transformers is imported, so checking never
    imports it (modelpar works without the ``hf`` extra).
    """
    cache_type = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return isinstance(cache_type, type) and isinstance(value, cache_type)


def _without_kv_cache(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, keep: bool = False
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The call's arguments with every key/value cache replaced by ``None`` and ``use_cache`` turned off.

    A cache written inside the recomputed region is written again by the recomputation: Hugging Face decoder
    layers append to the cache they are given, so selective checkpointing fails ("not found in storage") and
    full checkpointing doubles the cache. Training does not need it, so it is dropped, as Hugging Face's own
    gradient checkpointing does. The cache is found by its type, not by its argument's name: transformers
    5.24 renamed the layers' ``past_key_values`` to ``cache`` (the old name still accepted), and a layer may
    take it positionally. ``past_key_values`` is dropped by name too, whatever it holds (legacy tuple caches).
    ``keep``: the layer only reads its cache (transformers marks such layers ``_can_checkpoint_with_cache``), so
    the recomputation reads the same states and the cache stays; ``use_cache`` is still turned off.
    """
    if keep:
        return args, {**kwargs, "use_cache": False} if kwargs.get("use_cache") else kwargs
    args = tuple(None if _is_kv_cache(a) else a for a in args)
    kwargs = {
        name: None if _is_kv_cache(value) or (name == "past_key_values" and value is not None) else value
        for name, value in kwargs.items()
    }
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return args, kwargs


def checkpoint_module(module: nn.Module, mode: Literal["full", "selective"]) -> None:
    """Recompute ``module``'s activations in backward: all of them (``"full"``) or all but :data:`SAVED_OPS`'."""
    reads_cache_only = bool(getattr(module, "_can_checkpoint_with_cache", False))  # transformers' flag
    module.forward = _CheckpointedForward(
        module.forward, selective=mode == "selective", reads_cache_only=reads_cache_only
    )


def is_checkpointed(module: nn.Module) -> str | None:
    """``"full"`` or ``"selective"`` if :func:`checkpoint_module` was applied to ``module``, else ``None``."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, _CheckpointedForward):
        return "selective" if forward.selective else "full"
    return None
