"""Where a tensor must live for a collective, and moving a shard there: CPU offload meets NCCL.

With ``cpu_offload`` FSDP2 keeps each sharded parameter's local tensor (and its gradient) on the CPU while the
mesh, and every process group in it, is a CUDA one on NCCL, which cannot communicate CPU tensors. Any code
that runs a collective on such a shard (gathering it whole for an export, reducing a gradient norm) must copy
it to the device the group serves first, as torch's own state-dict gathering does. The decision is pure
(:func:`collective_device`, testable without a GPU); :func:`collective_ready` and :func:`group_device_types`
apply it to a DTensor's mesh and to a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

__all__ = [
    "broadcast_module_states",
    "collective_device",
    "collective_ready",
    "group_device_types",
    "served_device_types",
]


def served_device_types(backend: str, device: torch.device) -> tuple[str, ...]:
    """The device types a process group with this ``backend`` communicates on, the preferred first.

    ``backend`` is what ``dist.get_backend_config(group)`` returns, one backend per device type
    (``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``), or a plain name as ``dist.get_backend(group)`` returns it
    (``"nccl"``). A plain name torch does not know is trusted with ``device`` (the tensor's own).
    """
    if ":" in backend:
        return tuple(part.split(":", 1)[0] for part in backend.split(","))
    return tuple(dist.Backend.backend_capability.get(backend, [device.type]))


def collective_device(device: torch.device, device_types: Sequence[str]) -> torch.device:
    """Where a tensor on ``device`` must be for a collective on a group (or mesh) serving ``device_types``.

    A device the group serves is kept (no copy). Otherwise the first served type: the CPU, or the current
    device of an accelerator (``cuda:<current>`` for a CPU-offloaded shard under NCCL).
    """
    if device.type in device_types:
        return device
    target = device_types[0]
    if target == "cpu":
        return torch.device("cpu")
    return torch.device(target, torch.get_device_module(target).current_device())


def group_device_types(device: torch.device, group: Any = None) -> tuple[str, ...]:
    """The device types the process group ``group`` (the default one: ``None``) communicates on."""
    return served_device_types(dist.get_backend_config(group), device)


def collective_ready(tensor: DTensor) -> DTensor:
    """``tensor`` with its local shard on the device its mesh communicates on (``mesh.device_type``).

    The same DTensor when it is there already; otherwise a copy of the local shard, re-wrapped with the same
    mesh, placements, global shape and stride (no communication), so ``full_tensor()`` or ``redistribute()``
    can run on it under NCCL. The result lives on the accelerator: move what it yields back where needed.
    """
    mesh = tensor.device_mesh
    local = tensor.to_local()
    target = collective_device(local.device, (mesh.device_type,))
    if target == local.device:
        return tensor
    return DTensor.from_local(
        local.to(target), mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )


def broadcast_module_states(module: torch.nn.Module, src: int = 0) -> None:
    """Give every rank global rank ``src``'s parameters and buffers, before the module is sharded.

    FSDP1's ``sync_module_states=True``, for models whose ranks were not initialized alike: each tensor is
    broadcast over the default group, through the device that group communicates on (a CPU model under NCCL goes
    through the GPU and back). Tensors on the meta device on every rank are skipped: they have no values yet, and
    the strategy materializes them identically everywhere. The ranks first agree on which tensors are meta, so a
    model real on one rank and meta on another raises the same ``ValueError`` on every rank instead of hanging.
    """
    tensors = list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())  # tied ones once
    meta = [t.is_meta for t in tensors]
    every: list[list[bool] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, meta)
    differing = sorted({rank for rank, flags in enumerate(every) if flags != every[src]})
    if differing:
        raise ValueError(
            f"`sync_module_states=True` broadcasts rank {src}'s weights, but ranks {differing} hold meta tensors where"
            f" rank {src} holds values (or the reverse). Build the model the same way on every rank: with real"
            " weights everywhere, or on the meta device everywhere (`fabric.init_module(empty_init=True)`) and then"
            " load the weights with `fabric.load_raw(path, model)` or `modelpar.hf.load_pretrained`."
        )
    for tensor, is_meta in zip(tensors, meta, strict=True):
        if is_meta:
            continue
        target = collective_device(tensor.device, group_device_types(tensor.device))
        data = tensor.detach()
        staged = data if target == data.device else data.to(target)
        dist.broadcast(staged, src=src)
        if staged is not data:
            data.copy_(staged)
