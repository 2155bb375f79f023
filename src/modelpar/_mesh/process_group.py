"""Process-group set-up and the few collectives a strategy exposes (cluster detection: :mod:`.cluster`).

Written against ``torch.distributed``, so the Fabric adapter, the Trainer adapter and a plain ``torchrun``,
``srun``, ``jsrun`` or ``mpirun`` script all go through the same code. Also the restart-store prefix, which keeps a
restarted run's store keys apart from the crashed attempt's.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
)

from modelpar._errors import UnsupportedReduceOpError
from modelpar._mesh.groups import binds_device

__all__ = [
    "DEFAULT_TIMEOUT",
    "all_reduce",
    "barrier",
    "broadcast_object",
    "default_backend",
    "init_process_group",
    "restart_store_prefix",
]

#: torch's own default for non-NCCL groups; long enough for slow first compiles, short enough to end hangs.
DEFAULT_TIMEOUT = timedelta(minutes=30)


def default_backend(device: torch.device) -> str:
    """NCCL for CUDA devices, gloo for everything else (CPU tests, CI)."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(
    cluster_environment: ClusterEnvironment, backend: str, timeout: timedelta | None, device: torch.device
) -> None:
    """Create the default process group from ``cluster_environment`` unless one exists already.

    An existing group is reused only if it agrees with the environment on rank and world size: a mismatch
    (say, ``num_nodes`` wrong in a re-created Fabric) would otherwise build meshes over the wrong ranks.
    """
    if dist.is_initialized():
        rank, world = cluster_environment.global_rank(), cluster_environment.world_size()
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):
            raise RuntimeError(
                f"A process group already exists with rank {dist.get_rank()} of {dist.get_world_size()}, but the"
                f" cluster environment says rank {rank} of {world}. Check `num_nodes` and `devices`, or destroy"
                " the existing group (`torch.distributed.destroy_process_group()`) first."
            )
        return
    os.environ["MASTER_ADDR"] = cluster_environment.main_address
    os.environ["MASTER_PORT"] = str(cluster_environment.main_port)
    kwargs: dict[str, Any] = {}
    if binds_device(backend, device.type):
        kwargs["device_id"] = device  # NCCL only: a bound gloo group could not build the mesh (binds_device says why)
    prefix = restart_store_prefix(os.environ)
    if prefix is not None:  # the same store as the attempt before: its keys go under this attempt's name
        store = dist.TCPStore(
            cluster_environment.main_address,
            cluster_environment.main_port,
            cluster_environment.world_size(),
            is_master=False,
            timeout=timeout or DEFAULT_TIMEOUT,
        )
        kwargs["store"] = dist.PrefixStore(prefix, store)
    dist.init_process_group(
        backend,
        rank=cluster_environment.global_rank(),
        world_size=cluster_environment.world_size(),
        timeout=timeout or DEFAULT_TIMEOUT,
        **kwargs,
    )
    atexit.register(_destroy_at_exit)


def restart_store_prefix(env: Mapping[str, str]) -> str | None:
    """A key prefix for a job that torchrun restarted (``--max-restarts``), or ``None`` where none is needed.

    torchrun's agent hosts the store that the workers' process group rendezvous through, and keeps it across
    restarts (``TORCHELASTIC_USE_AGENT_STORE=True``). torch puts no attempt in the keys, so the restarted ranks
    could read the killed attempt's gloo addresses and fail with "Connection refused" (seen in 1 of 2 restarts).
    """
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"modelpar/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _destroy_at_exit() -> None:
    """Shut down the group we created, and let gloo's worker threads finish, before the interpreter tears down.

    A gloo worker thread releases a finished collective's tensors after the caller has moved on; when the
    caller's Python object is gone by then, the release takes the GIL. If that happens once the interpreter
    is finalizing, Python ends the thread inside a C++ destructor and the process aborts ("terminate called
    without an active exception", exit code -6) after the script has finished, often right after its last
    collective, and whether or not ``destroy_process_group`` ran: the groups outlive it in whatever still
    references them (a model's FSDP state, a device mesh). Releasing the GIL for a moment lets those threads
    finish while the interpreter is whole. Background checkpoint writes are joined before atexit handlers run.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    time.sleep(_GLOO_SETTLE_S)


#: How long the exit handler releases the GIL for gloo's worker threads (they need microseconds).
_GLOO_SETTLE_S = 0.02


def all_reduce(tensor: torch.Tensor, group: Any = None, reduce_op: Any = "mean") -> torch.Tensor:
    """Reduce ``tensor`` in place across ``group`` (all ranks by default) and return it.

    ``reduce_op`` is a ``torch.distributed.ReduceOp`` or one of ``"mean"``/``"avg"``, ``"sum"``, ``"max"``,
    ``"min"``, ``"product"``. Mean is a sum then a division, because gloo has no ``AVG``.
    Without a process group it returns ``tensor`` unchanged, so single-process code runs as is.
    """
    if not dist.is_initialized():
        return tensor
    op: Any = reduce_op
    mean = False
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        mean = name in ("mean", "avg")
        names = {"sum": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT", "prod": "PRODUCT"}
        if not mean and name not in names:
            raise UnsupportedReduceOpError(
                f"`reduce_op={reduce_op!r}` is not supported. Use 'mean', 'sum', 'max', 'min', 'product'"
                " or a `torch.distributed.ReduceOp`."
            )
        op = dist.ReduceOp.SUM if mean else getattr(dist.ReduceOp, names[name])
    dist.all_reduce(tensor, op=op, group=group)
    if mean:
        size = dist.get_world_size(group)
        if torch.is_floating_point(tensor) or torch.is_complex(tensor):
            tensor.div_(size)
        else:
            tensor.copy_(tensor // size)
    return tensor


def barrier(device: torch.device) -> None:
    """Wait for all ranks; a no-op without a process group."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` on every rank (picklable objects); identity without a process group."""
    if not dist.is_initialized():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]
