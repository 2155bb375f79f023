"""Staging for asynchronous saves: one copy of the state, from where it lives, into reused CPU memory.

An asynchronous save returns once the state is *staged*: a snapshot that what the training does next cannot
reach. The state is taken as it lives (device tensors and DTensors for the distributed format, no CPU
offload first), and :class:`Staging` copies each tensor once into CPU memory that it keeps for the next
save, pinned where the tensor comes from a GPU (:func:`staging_memory`). The full format gathers rank 0's
full state into fresh CPU tensors already: those are taken as they are (:func:`private_tensors`), and only
what still shares memory with the live model or optimizer is copied, so rank 0 never holds the full state
twice.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["Staging", "StagingMemory", "live_storages", "private_tensors", "staging_memory"]

#: Device types whose tensors are staged into pinned (page-locked) memory, copied without blocking.
_PINNED_FROM = frozenset({"cuda"})


@dataclass(frozen=True)
class StagingMemory:
    """How the CPU copy of a tensor is made: ``pinned`` memory, and a ``non_blocking`` copy into it."""

    pinned: bool
    non_blocking: bool


def staging_memory(source: torch.device) -> StagingMemory:
    """The CPU memory for staging a tensor that lives on ``source``.

    From a GPU: pinned, so the copy runs by DMA at full bandwidth without blocking, and the ranks' copies of
    all tensors overlap; the buffers are kept for the run, so pinning (slow, and it locks host memory) is paid
    once. From the CPU (a model trained on the CPU, or state offloaded already): pageable, since pinning
    would lock host memory for a plain memcpy.
    """
    pinned = source.type in _PINNED_FROM
    return StagingMemory(pinned=pinned, non_blocking=pinned)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (the very tensor, under ``no_grad``), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storage(tensor: torch.Tensor) -> int:
    """Where the memory behind ``tensor`` (its shard, for a DTensor) starts; 0 for no memory."""
    local = _local(tensor)
    return int(local.untyped_storage().data_ptr()) if local.device.type != "meta" else 0


def live_storages(modules: Iterable[nn.Module], optimizers: Iterable[Optimizer]) -> set[int]:
    """The memory that the training keeps changing: parameters, buffers and optimizer state tensors."""
    live: set[int] = set()
    for module in modules:
        live.update(_storage(t) for t in (*module.parameters(), *module.buffers()))
    for optimizer in optimizers:
        for state in optimizer.state.values():
            live.update(_storage(t) for _, t in _tensors(state, ()))
    live.discard(0)
    return live


def private_tensors(state: Mapping[str, Any], live: Collection[int]) -> set[int]:
    """The ``id`` of each CPU tensor in ``state`` whose memory is none of ``live``: it may be written as is.

    A full state dict gathered with CPU offload holds fresh CPU tensors, except where gathering had nothing
    to do (a tensor not sharded on a CPU model, an optimizer's ``step`` counter): those are the live ones.
    """
    private = set()
    for _, tensor in _tensors(state, ()):
        if type(tensor) is not torch.Tensor or tensor.device.type != "cpu":
            continue
        storage = _storage(tensor)
        if storage != 0 and storage not in live:
            private.add(id(tensor))
    return private


class Staging(AsyncStager):
    """A snapshot of a state for a background write: what happens after ``save`` returns cannot reach it.

    Every tensor (weights, optimizer moments and ``step`` counters, tensors in metadata; DTensors as DTensors
    with a CPU shard) is copied to CPU memory, except those :meth:`stage` is told are private already, and
    everything else, containers included, is deep-copied. ``dcp.async_save`` calls :meth:`stage` (the
    distributed format); the full format calls it directly. The copies are kept and refilled by the next
    ``stage`` where the tensor at the same place in the state has the same layout (type, shape, stride,
    dtype, device, placements), so a run allocates, and from a GPU pins, them once; :meth:`close` releases
    them. ``staged_bytes``: what the last :meth:`stage` copied.
    """

    _synchronize_after_execute = False  # the copy is complete when ``stage`` returns

    def __init__(self) -> None:
        self._copies: dict[tuple[Any, ...], tuple[tuple[Any, ...], torch.Tensor]] = {}
        self.staged_bytes = 0

    def stage(self, state_dict: dict[str, Any], *, private: Collection[int] = ()) -> dict[str, Any]:
        """A snapshot of ``state_dict``; tensors whose ``id`` is in ``private`` are put in it as they are."""
        copies: dict[tuple[Any, ...], tuple[tuple[Any, ...], torch.Tensor]] = {}
        memo: dict[int, Any] = {}  # id(tensor) -> its copy, for ``copy.deepcopy`` to put in place
        staged = 0
        pending: set[torch.device] = set()  # devices with copies still in flight
        with torch.no_grad():
            for where, tensor in _tensors(state_dict, ()):
                if id(tensor) in memo:  # one tensor at two places: one copy, as in the original
                    continue
                if id(tensor) in private:
                    memo[id(tensor)] = tensor
                    continue
                source = _local(tensor)
                memory = staging_memory(source.device)
                layout = _layout(tensor)
                kept = self._copies.get(where)
                target = kept[1] if kept is not None and kept[0] == layout else _empty_cpu_like(tensor, memory)
                _local(target).copy_(source, non_blocking=memory.non_blocking)
                if memory.non_blocking:
                    pending.add(source.device)
                staged += source.numel() * source.element_size()
                copies[where] = (layout, target)
                memo[id(tensor)] = target
        for device in pending:
            torch.cuda.synchronize(device)  # the snapshot is complete when ``stage`` returns
        self._copies = copies
        self.staged_bytes = staged
        # Tensors inside other objects than dicts, lists and tuples are cloned by ``deepcopy`` itself.
        return copy.deepcopy(state_dict, memo)

    def synchronize_staging(self) -> None:
        """Nothing to wait for: :meth:`stage` copies synchronously."""

    def close(self) -> None:
        self._copies = {}


def _tensors(value: Any, where: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """The plain tensors and DTensors in nested dicts, lists and tuples, with their places."""
    if type(value) in (torch.Tensor, DTensor):
        yield where, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, (*where, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors(item, (*where, index))


def _layout(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What a kept copy must match to be refilled with ``tensor``."""
    local = _local(tensor)
    spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride()) if isinstance(tensor, DTensor) else ()
    return (type(tensor), local.shape, local.stride(), local.dtype, local.device, tensor.requires_grad, spec)


def _empty_cpu_like(tensor: torch.Tensor, memory: StagingMemory) -> torch.Tensor:
    """CPU memory for a copy of ``tensor``, pinned or not as ``memory`` says."""
    return torch.empty_like(tensor, device="cpu", pin_memory=memory.pinned).requires_grad_(tensor.requires_grad)
