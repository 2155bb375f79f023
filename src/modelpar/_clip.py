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

The local work is batched and makes no copies: local shards are grouped by (device, dtype, weight); each
group's norm comes from ``torch.nn.utils.get_total_norm`` (foreach kernels; per-tensor norms in the gradients'
dtype, as torch's own clipping computes them); the few group norms are combined in fp32 (fp64 if any gradient
is fp64) on the device the process group communicates on, so CPU-offloaded gradients never reach NCCL; and
``torch.nn.utils.clip_grads_with_norm_`` scales the local shards in place.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate

__all__ = ["clip_grad_norm", "clip_grad_value"]


def _local(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank owns; in-place ops on it update the (D)Tensor gradient."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _made_whole(grad: DTensor) -> DTensor:
    """A Partial (pending-sum) gradient summed first: its local parts are not disjoint pieces of it."""
    placements = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, placements)


def _layout(mesh: DeviceMesh, placements: tuple[Placement, ...]) -> tuple[int, bool]:
    """How many distinct pieces a gradient with this layout is cut into once whole, and whether it is Partial.

    The pieces: the product of the sizes of the axes that are neither replicated nor Partial (a Partial axis is
    replicated once summed). "Not replicated" rather than ``is_shard()``: FSDP over TP uses a strided placement
    that is a shard in all but name (it reports ``is_shard() == False``).
    """
    sharded = (i for i, p in enumerate(placements) if not (p.is_replicate() or p.is_partial()))
    return math.prod(mesh.size(i) for i in sharded), any(p.is_partial() for p in placements)


def _communication_device(backend: str, device: torch.device) -> torch.device:
    """Where a tensor on ``device`` must be for a collective on a process group with this ``backend``.

    ``backend`` is what ``dist.get_backend_config(group)`` returns, one backend per device type
    (``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``), or a plain name as ``dist.get_backend(group)`` returns it
    (``"nccl"``). A device the group serves is kept; otherwise the tensor goes to the group's first device type
    (the current CUDA device for a CPU tensor under NCCL, as with CPU-offloaded gradients). A plain name torch
    does not know is trusted with ``device``.
    """
    if ":" in backend:
        device_types = [part.split(":", 1)[0] for part in backend.split(",")]
    else:
        device_types = dist.Backend.backend_capability.get(backend, [device.type])
    if device.type in device_types:
        return device
    target = device_types[0]
    if target == "cpu":
        return torch.device("cpu")
    return torch.device(target, torch.get_device_module(target).current_device())


@torch.no_grad()
def clip_grad_norm(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = True,
) -> torch.Tensor:
    """Clip gradients so their global ``norm_type``-norm is at most ``max_norm``; return the norm before clipping.

    Same contract as ``torch.nn.utils.clip_grad_norm_``, but correct for gradients spread over several meshes
    (and plain tensors). The returned norm is a plain tensor with the same value on every rank, on the device
    and in the dtype of the first gradient.
    """
    norm_type = float(norm_type)
    # Local tensors to norm, grouped by what their norms share: device, dtype and weight (distinct shards).
    groups: dict[tuple[torch.device, torch.dtype, int], list[torch.Tensor]] = {}
    # What `clip_grads_with_norm_` scales through `.grad`: a parameter with a plain gradient as it is, a local
    # shard on a detached alias of itself (scaling each pending-sum part of a Partial gradient scales its sum).
    to_scale: list[torch.Tensor] = []
    first: torch.Tensor | None = None  # the first local gradient: the returned norm's device and dtype
    # Layouts by identity: gradients share mesh and placement objects, whose Python hashes cost ~1 us per
    # gradient. Each entry holds its objects, so no id can be reused while this call runs.
    layouts: dict[tuple[int, int], tuple[DeviceMesh, tuple[Placement, ...], int, bool]] = {}
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
            _, _, shards, partial = cached
            normed = _made_whole(grad).to_local() if partial else local
            key = (local.device, local.dtype, shards)
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
    comm_device = _communication_device(dist.get_backend_config(), first.device) if world > 1 else first.device
    acc_dtype = torch.float64 if any(dtype == torch.float64 for _, dtype, _ in groups) else torch.float32
    parts = [torch.zeros((), dtype=acc_dtype, device=comm_device)]  # for a rank whose shards are all empty
    for (_, _, shards), tensors in groups.items():
        norm = torch.nn.utils.get_total_norm(tensors, norm_type).to(comm_device, acc_dtype)
        parts.append(norm if math.isinf(norm_type) else norm.pow(norm_type) * (shards / world))
    stacked = torch.stack(parts)
    acc = stacked.max() if math.isinf(norm_type) else stacked.sum()  # copies do not change a maximum
    if world > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total = (acc if math.isinf(norm_type) else acc.pow(1.0 / norm_type)).to(first.device, first.dtype)
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
