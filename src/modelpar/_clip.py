"""Gradient clipping that understands N-D meshes, with one collective for the whole model.

After FSDP2 + tensor parallelism, gradients live on different meshes: TP-sharded weights on the 2-D
``(data_parallel, tensor_parallel)`` mesh, norms that only FSDP touched on the 1-D ``data_parallel``
sub-mesh. ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms and fails on such a mix ("All operands
in aten.stack.default must have the same mesh").

Here each rank sums ``|g_local|^p`` over its local shards, each weighted by ``distinct shards / world size``:
a shard held by ``k`` ranks (replicated along some axes, or on a sub-mesh repeated across the others) is then
counted exactly once by a single all-reduce over all ranks. That is one collective per clipping call,
whatever the number of parameters and meshes. It assumes what the strategy guarantees: every mesh is a slice
of one mesh over all ranks, and every rank holds the same parameters. Clipping then scales local shards
in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["clip_grad_norm", "clip_grad_value"]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns; in-place ops on it update the (D)Tensor gradient."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _without_partial(grad: torch.Tensor) -> torch.Tensor:
    """Partial (pending-sum) gradients are made whole first: their local parts are not disjoint pieces."""
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        placements = [Replicate() if p.is_partial() else p for p in grad.placements]
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def _distinct_shards(grad: torch.Tensor) -> int:
    """How many different pieces the gradient is cut into: the product of its non-replicated axis sizes.

    "Not replicated" rather than ``is_shard()``: FSDP over TP uses a strided placement that is a shard in all
    but name (it reports ``is_shard() == False``).
    """
    if not isinstance(grad, DTensor):
        return 1
    mesh = grad.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if not p.is_replicate())


def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = True,
) -> torch.Tensor:
    """Clip gradients so their global ``norm_type``-norm is at most ``max_norm``; return the norm before clipping.

    Same contract as ``torch.nn.utils.clip_grad_norm_``, but correct for gradients spread over several meshes
    (and plain tensors). The returned norm is a plain tensor with the same value on every rank.
    """
    norm_type = float(norm_type)
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = _local(grads[0]).device
    world = dist.get_world_size() if dist.is_initialized() else 1
    whole = [_without_partial(g) for g in grads]
    local_norms = torch.stack([torch.linalg.vector_norm(_local(g).double(), norm_type).to(device) for g in whole])
    if math.isinf(norm_type):
        acc = local_norms.max()  # copies do not change a maximum
    else:
        weights = torch.tensor([_distinct_shards(g) / world for g in whole], dtype=torch.float64, device=device)
        acc = (local_norms.pow(norm_type) * weights).sum()
    if world > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total = (acc if math.isinf(norm_type) else acc.pow(1.0 / norm_type)).to(_local(grads[0]).dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is {total.item()}, so they cannot be"
            " clipped. Check the loss for NaN/inf, or pass `error_if_nonfinite=False` to clip anyway."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:  # scaling each pending-sum part of a Partial gradient scales its sum exactly
            local = _local(g)
            local.mul_(coef.to(local.dtype))
    return total


def clip_grad_value(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element into ``[-clip_value, clip_value]``; elementwise, so shards clip alone."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                _local(p.grad).clamp_(-clip_value, clip_value)
