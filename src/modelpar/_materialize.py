"""Meta-device materialization: allocate real storage for a (sharded) module and initialize it.

The idiom, written plainly: build the model under ``torch.device("meta")`` (no memory), shard it
with ``parallelize_fn`` (still no memory), then ``to_empty`` allocates only each rank's shard on the
real device and ``reset_parameters()`` fills it. On accelerator meshes DTensor's random ops keep sharded
and replicated initialization consistent across ranks, so every rank ends up with its part of one
coherent model.

DTensor has no random-number support on CPU meshes: there a random op on a DTensor fills each rank's
local shard from that rank's own generator (torch warns "DTensor random operators may not have complete
support on cpu device mesh"), so with one seed on every rank all shards of a weight come out identical.
On such meshes each module is therefore initialized at full size on plain tensors and every rank keeps
its slice: the result equals a single-process model built after the same ``torch.manual_seed``, at the
cost of one module's full-size tensors at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TypeGuard

import torch
from lightning_fabric.utilities import rank_zero_warn
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["has_meta_tensors", "materialize_module"]


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False)))


def has_meta_tensors(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) lives on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def _without_dtensor_rng(t: torch.Tensor) -> TypeGuard[DTensor]:
    """A DTensor on a mesh whose device has no RNG state DTensor could drive (torch's own test, no warning)."""
    return isinstance(t, DTensor) and not hasattr(getattr(torch, t.device_mesh.device_type, None), "set_rng_state")


def _reset_at_full_size(module: nn.Module, reset: Callable[[], None]) -> None:
    """Run ``reset`` on full-size plain stand-ins for ``module``'s DTensors, then keep this rank's slice.

    Every rank draws the same full tensors (same seed) and slices them locally, with no communication.
    A stand-in that ``reset`` replaced is left as ``reset`` set it, as calling ``reset`` directly would.
    """
    swapped: dict[str, tuple[DTensor, torch.Tensor]] = {}
    for name, t in _own_tensors(module):
        if _without_dtensor_rng(t):
            full = torch.empty(t.shape, dtype=t.dtype, device=t.to_local().device)
            stand_in = nn.Parameter(full, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else full
            swapped[name] = (t, stand_in)
            setattr(module, name, stand_in)
    try:
        reset()
    finally:
        kept = {name: pair for name, pair in swapped.items() if getattr(module, name) is pair[1]}
        for name, (original, _) in kept.items():
            setattr(module, name, original)
    for original, stand_in in kept.values():  # reached only when reset() returned
        mesh, placements = original.device_mesh, original.placements
        shard = distribute_tensor(stand_in.detach(), mesh, placements, src_data_rank=None).to_local()
        with torch.no_grad():
            original.to_local().copy_(shard)


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
        if callable(reset) and any(_without_dtensor_rng(t) for _, t in _own_tensors(submodule)):
            _reset_at_full_size(submodule, reset)
        elif callable(reset):
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
