"""Gradient clipping that understands N-D meshes.

After FSDP2 + tensor parallelism, gradients live on different meshes: TP-sharded weights on the 2-D
``(data_parallel, tensor_parallel)`` mesh, norms and biases that only FSDP touched on the 1-D
``data_parallel`` sub-mesh. ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms and fails on
such a mix ("All operands in aten.stack.default must have the same mesh"). Here gradients are grouped by
``(mesh, placements)``; each group contributes ``sum(|g_local|^p)`` reduced over only the mesh axes that
shard it (one collective per group, none for replicated axes), and the groups combine into the global norm
every rank agrees on. Clipping then scales each rank's local shards in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

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


def _group_norm_power(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """``sum |g|^p`` (or ``max |g|`` for p = inf) over whole gradients of one (mesh, placements) group."""
    locals_ = [_local(g) for g in grads]
    norms = torch.stack([torch.linalg.vector_norm(t.float(), norm_type) for t in locals_])
    local_value = norms.max() if math.isinf(norm_type) else norms.pow(norm_type).sum()
    first = grads[0]
    if not isinstance(first, DTensor):
        return local_value
    op = "max" if math.isinf(norm_type) else "sum"
    # Sharded axes hold disjoint pieces -> reduce over them; replicated axes hold copies -> leave them alone.
    # "Not replicated" rather than `is_shard()`: FSDP over TP shards with a strided placement that is a
    # shard in all but name (it reports `is_shard() == False`).
    placements: list[Placement] = [Replicate() if p.is_replicate() else Partial(op) for p in first.placements]
    return DTensor.from_local(local_value, first.device_mesh, placements, run_check=False).full_tensor()


def _grouped(grads: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    groups: dict[object, list[torch.Tensor]] = {}
    for g in grads:
        key: object = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else ("plain", g.device)
        groups.setdefault(key, []).append(g)
    return list(groups.values())


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
    whole = [_without_partial(g) for g in grads]
    contributions = [_group_norm_power(group, norm_type).to(device) for group in _grouped(whole)]
    stacked = torch.stack(contributions)
    total = stacked.max() if math.isinf(norm_type) else stacked.sum().pow(1.0 / norm_type)
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
