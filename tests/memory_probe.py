"""Measured activation memory on CPU: bytes live after a forward and loss, and the bytes autograd saves.

``live_after`` runs a step under the CPU profiler with memory profiling and sums every op's own allocations
minus frees: what the step allocated and still holds when it returns (the activations kept for backward, the
logits, the loss; with FSDP2, the root's gathered parameters). It sees inside activation checkpointing, which
hides the tensors it keeps from outer ``saved_tensors_hooks``. ``saved_for_backward`` counts what autograd
packs, each storage once, parameters and buffers excluded: the same figure without checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.profiler import ProfilerActivity, profile

__all__ = ["live_after", "saved_for_backward"]


def live_after(step: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes ``step`` allocated and still holds when it returns, its result)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = step()
    return sum(event.self_cpu_memory_usage for event in prof.key_averages()), result


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()


def saved_for_backward(model: nn.Module, step: Callable[[], Any]) -> tuple[int, Any]:
    """(bytes of the distinct storages autograd saves during ``step``, parameters and buffers excluded, result)."""
    owned = {_storage(t).data_ptr() for t in [*model.parameters(), *model.buffers()]}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = _storage(t)
        if storage.data_ptr() not in owned:
            saved.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = step()
    return sum(saved.values()), result
