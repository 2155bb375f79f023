"""Meta-device materialization: allocate real storage for a (sharded) module and initialize it.

The idiom, written plainly: build the model under ``torch.device("meta")`` (no memory), shard it
with ``parallelize_fn`` (still no memory), then ``to_empty`` allocates only each rank's shard on the
real device and ``reset_parameters()`` fills it. DTensor's random ops keep sharded and replicated
initialization consistent across ranks, so every rank ends up with its part of one coherent model.
"""

from __future__ import annotations

import itertools

import torch
from lightning_fabric.utilities import rank_zero_warn
from torch import nn

__all__ = ["has_meta_tensors", "materialize_module"]


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)))


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) lives on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _meta_tensor_names(module: nn.Module) -> list[str]:
    names = [n for n, p in module.named_parameters() if p.is_meta]
    return names + [n for n, b in module.named_buffers() if b.is_meta]


def materialize_module(module: nn.Module, device: torch.device) -> None:
    """Allocate every meta tensor of ``module`` on ``device`` and re-initialize it in place.

    ``reset_parameters()`` is called on each submodule that owns parameters or buffers; the classes
    without one are named in a rank-0 warning, because their tensors hold uninitialized memory.
    Raises ``RuntimeError`` naming any tensor still on the meta device afterwards (a ``reset_parameters``
    that re-created a tensor on meta, for example), since training on it would fail far from the cause.
    """
    if not has_meta_tensors(module):
        return
    module.to_empty(device=device)  # on the root, so shared (tied) tensors stay shared
    uninitialized: set[str] = set()
    for submodule in module.modules():
        if not _own_tensors(submodule):
            continue
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset):
            reset()
        else:
            uninitialized.add(type(submodule).__name__)
    if uninitialized:
        rank_zero_warn(
            "Meta-device initialization is incomplete: these module classes own parameters or buffers but"
            " define no `reset_parameters()`, so their tensors hold uninitialized memory:"
            f" {', '.join(sorted(uninitialized))}. Define `reset_parameters()` on them, or load a checkpoint"
            " before training."
        )
    still_meta = _meta_tensor_names(module)
    if still_meta:
        raise RuntimeError(
            f"After materialization, {len(still_meta)} tensor(s) are still on the meta device:"
            f" {', '.join(still_meta[:10])}{' ...' if len(still_meta) > 10 else ''}. A `reset_parameters()`"
            " probably re-created them on the meta device; make it fill the existing tensors in place"
            " (e.g. `nn.init.*` or `tensor.copy_`)."
        )
