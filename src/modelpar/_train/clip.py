"""Gradient clipping that understands N-D meshes, with one collective for the whole model.

After FSDP2 + tensor parallelism, gradients live on different meshes: TP-sharded weights on the 2-D
``(data_parallel, tensor_parallel)`` mesh, norms that only FSDP touched on the 1-D ``data_parallel``
sub-mesh. ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms and fails on such a mix ("All operands
in aten.stack.default must have the same mesh").

Here each rank sums ``|g_local|^p`` over its local shards, each weighted by ``distinct shards / world size``:
a shard held by ``k`` ranks (replicated along some axes, or on a sub-mesh repeated across the others) is then
counted exactly once by a single all-reduce over all ranks. That is one collective per clipping call,
whatever the number of parameters and meshes. It assumes what the strategy guarantees: every mesh is a slice
of one mesh over all ranks, and every rank holds the same parameters.

Pending-sum (``Partial``) gradients need their sum before any norm (the norm of a sum is not a sum of norms).
FSDP2 sums them itself before the optimizer sees them, so under the strategy's plans there are none; they
arise with tensor parallelism alone (Hugging Face's per-head ``q_norm`` / ``k_norm``). Those that are
``Partial`` or replicated on every axis ride in the same all-reduce: their local parts are appended to it, the
sum over all ranks is their sum times ``world size / ranks summed``, and every rank then norms the whole
gradient itself. So they cost no extra collective, only their size in the one all-reduce. A ``Partial``
gradient that is also sharded on some axis is summed first (``redistribute``): one more collective each.

The local work is batched and copies nothing but those Partial gradients: local shards are grouped by (device,
dtype, weight); each group's norm comes from ``torch.nn.utils.get_total_norm`` (foreach kernels; per-tensor
norms in the gradients' dtype, as torch's own clipping computes them); the few group norms are combined in fp32
(fp64 if any gradient is fp64) on the device the process group communicates on (``modelpar._mesh.collective``), so
CPU-offloaded gradients never reach NCCL; and ``torch.nn.utils.clip_grads_with_norm_`` scales the local shards
in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

from modelpar._mesh.collective import collective_device, collective_ready, group_device_types

__all__ = ["clip_grad_norm", "clip_grad_value"]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns; in-place ops on it update the (D)Tensor gradient."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _made_whole(grad: DTensor) -> DTensor:
    """A Partial (pending-sum) gradient summed first: its local parts are not disjoint pieces of it."""
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    whole = collective_ready(grad)  # a CPU-offloaded gradient goes to the mesh's device for the sum
    return whole.redistribute(whole.device_mesh, placements)


def _layout(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, int]:
    """How many distinct pieces a gradient with this layout is cut into once whole, and how many ranks its
    pending sum (``Partial``) runs over (0 when it is not ``Partial``).

    The pieces: the product of the sizes of the axes that are neither replicated nor Partial (a Partial axis is
    replicated once summed). "Not replicated" rather than ``is_shard()``: FSDP over TP uses a strided placement
    that is a shard in all but name (it reports ``is_shard() == False``).
    """
    sharded = (i for i, p in enumerate(placements) if not (p.is_replicate() or p.is_partial()))
    summed = [mesh.size(i) for i, p in enumerate(placements) if p.is_partial()]
    return math.prod(mesh.size(i) for i in sharded), math.prod(summed) if summed else 0


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = True,
    *,
    pipeline_parallel_size: int = 1,
) -> torch.Tensor:
    """Clip gradients so their global ``norm_type``-norm is at most ``max_norm``; return the norm before clipping.

    Same contract as ``torch.nn.utils.clip_grad_norm_``, but correct for gradients spread over several meshes
    (and plain tensors). The returned norm is a plain tensor with the same value on every rank, on the device
    and in the dtype of the first gradient. One all-reduce over all ranks per call, plus one per ``Partial``
    gradient that is also sharded (see the module's docstring).

    Under pipeline parallelism (``pipeline_parallel_size > 1``) each rank holds its stages' parameters only: a
    shard is held by ``world / pp`` ranks, not ``world``, so its weight is ``shards x pp / world``, and the one
    all-reduce adds the stages up. Partial gradients are summed first there (their parts differ per stage).
    """
    norm_type = float(norm_type)
    inf = math.isinf(norm_type)
    # Local tensors to norm, grouped by what their norms share: device, dtype and weight (distinct shards).
    groups: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
    # Partial gradients summed in the all-reduce itself: their local parts, by the ranks their sum runs over.
    pending: dict[int, list[torch.Tensor]] = {}
    # What `clip_grads_with_norm_` scales through `.grad`: a parameter with a plain gradient as it is, a local
    # shard on a detached alias of itself (scaling each pending-sum part of a Partial gradient scales its sum).
    to_scale: list[torch.Tensor] = []
    first: torch.Tensor | None = None  # the first local gradient: the returned norm's device and dtype
    # Layouts by identity: gradients share mesh and placement objects, whose Python hashes cost ~1 us per
    # gradient. Each entry holds its objects, so no id can be reused while this call runs.
    layouts: dict[tuple[int, int], tuple[DeviceMesh, tuple[Placement, ...], int, int]] = {}
    for param in parameters:
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            local = grad.to_local()
            holder = local.detach()
            holder.grad = local
            to_scale.append(holder)
            mesh, placements = grad.device_mesh, grad.placements
            cached = layouts.get((id(mesh), id(placements)))
            if cached is None:
                cached = layouts[(id(mesh), id(placements))] = (mesh, placements, *_layout(mesh, placements))
            _, _, shards, summed = cached
            if summed and shards == 1 and pipeline_parallel_size == 1:  # its sum rides in the one all-reduce
                pending.setdefault(summed, []).append(local)
                first = local if first is None else first
                continue
            normed = _made_whole(grad).to_local() if summed else local
            key = (normed.device, local.dtype, shards)
        else:
            to_scale.append(param)
            normed = local = grad
            key = (local.device, local.dtype, 1)
        if normed.numel():  # an empty shard (uneven sharding) adds nothing, and has no inf-norm
            groups.setdefault(key, []).append(normed)
        first = local if first is None else first
    if first is None:
        return torch.tensor(0.0)
    world = dist.get_world_size() if dist.is_initialized() else 1
    holders = world // pipeline_parallel_size  # the ranks that hold one stage's parameters
    comm_device = collective_device(first.device, group_device_types(first.device)) if world > 1 else first.device
    dtypes = {dtype for _, dtype, _ in groups} | {t.dtype for parts in pending.values() for t in parts}
    acc_dtype = torch.float64 if torch.float64 in dtypes else torch.float32
    parts = [torch.zeros((), dtype=acc_dtype, device=comm_device)]  # for a rank whose shards are all empty
    for (_, _, shards), tensors in groups.items():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type).to(comm_device, acc_dtype)
        parts.append(norm if inf else norm.pow(norm_type) * (shards / holders))
    stacked = torch.stack(parts)
    acc = stacked.max() if inf else stacked.sum()  # copies do not change a maximum
    # What the all-reduce sums: the local sum of p-th powers (the inf-norm: each rank's maximum in its own slot,
    # so that a sum gathers them), then the Partial gradients' local parts.
    head = world if inf and pending else 1
    size = sum(t.numel() for tensors in pending.values() for t in tensors)
    buffer = torch.zeros(head + size, dtype=acc_dtype, device=comm_device)
    buffer[dist.get_rank() if head > 1 else 0] = acc
    offset = head
    for tensors in pending.values():
        for t in tensors:
            buffer[offset : offset + t.numel()].copy_(t.reshape(-1))  # to the buffer's device and dtype
            offset += t.numel()
    if world > 1:
        op = dist.ReduceOp.MAX if inf and not pending else dist.ReduceOp.SUM
        dist.all_reduce(buffer, op=op)
    acc = buffer[:head].max() if inf else buffer[0]
    offset = head
    for summed, tensors in pending.items():  # each summed over all ranks: its whole, times world / summed
        size = sum(t.numel() for t in tensors)
        whole = buffer[offset : offset + size].mul_(summed / world)
        offset += size
        norm = torch.linalg.vector_norm(whole, norm_type)
        acc = torch.maximum(acc, norm) if inf else acc + norm.pow(norm_type)
    total = (acc if inf else acc.pow(1.0 / norm_type)).to(first.device, first.dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} of the gradients is {total.item()}, so they cannot be"
            " clipped. Check the loss for NaN/inf, or pass `error_if_nonfinite=False` to clip anyway."
        )
    torch.nn.utils.clip_grads_with_norm_(to_scale, max_norm, total)
    return total


def clip_grad_value(parameters: Iterable[torch.Tensor], clip_value: float) -> None:
    """Clamp every gradient element into ``[-clip_value, clip_value]``; elementwise, so shards clip alone."""
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                _local(p.grad).clamp_(-clip_value, clip_value)
