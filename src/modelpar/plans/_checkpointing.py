"""Activation checkpointing of a module in place, with public torch APIs and without a wrapper module.

The module's ``forward`` is replaced (on the instance) by one that runs the original under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``. No wrapper module is inserted, so parameter
and state-dict names stay exactly what they were (no ``_checkpoint_wrapped_module`` segment), and
``fully_shard`` applied afterwards puts its hooks *outside* the recomputed region, as with torchtitan's
wrapper: parameters are all-gathered once for backward and the recomputation uses them.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

__all__ = ["SAVED_OPS", "checkpoint_module", "is_checkpointed"]

_aten = torch.ops.aten
#: What ``"selective"`` keeps from forward: the outputs of matrix multiplies and attention (the costly ops);
#: everything else in the unit (norms, activations, rotary embeddings, elementwise ops) is recomputed.
SAVED_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "mm",
        "addmm",
        "bmm",
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

    def __init__(self, forward: Any, selective: bool) -> None:
        self.forward = forward
        self.selective = selective

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            # A key/value cache written inside the recomputed region would be written again by the recomputation
            # (Hugging Face decoder layers append to `past_key_values` when `use_cache`; selective checkpointing
            # then fails, full checkpointing doubles the cache). Training does not need it: drop it, as
            # Hugging Face's own gradient checkpointing does. Generation without gradients keeps its cache.
            if kwargs.get("use_cache"):
                kwargs["use_cache"] = False
            if kwargs.get("past_key_values") is not None:
                kwargs["past_key_values"] = None
        if self.selective:
            context_fn = partial(create_selective_checkpoint_contexts, _policy)
            return checkpoint(self.forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def checkpoint_module(module: nn.Module, mode: Literal["full", "selective"]) -> None:
    """Recompute ``module``'s activations in backward: all of them (``"full"``) or all but :data:`SAVED_OPS`'."""
    module.forward = _CheckpointedForward(module.forward, selective=mode == "selective")


def is_checkpointed(module: nn.Module) -> str | None:
    """``"full"`` or ``"selective"`` if :func:`checkpoint_module` was applied to ``module``, else ``None``."""
    forward = module.__dict__.get("forward")
    if isinstance(forward, _CheckpointedForward):
        return "selective" if forward.selective else "full"
    return None
