"""Process-group set-up, the few collectives a strategy exposes, and cluster detection for standalone use.

Written against ``torch.distributed`` and Lightning's public cluster-environment classes only, so the
Fabric adapter, the Trainer adapter and a plain ``torchrun`` script all go through the same code.
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "DetectedCluster",
    "all_reduce",
    "barrier",
    "broadcast_object",
    "default_backend",
    "detect_cluster",
    "init_process_group",
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
    if device.type == "cuda":
        kwargs["device_id"] = device  # binds NCCL eagerly to the right GPU
    dist.init_process_group(
        backend,
        rank=cluster_environment.global_rank(),
        world_size=cluster_environment.world_size(),
        timeout=timeout or DEFAULT_TIMEOUT,
        **kwargs,
    )
    atexit.register(_destroy_at_exit)


def _destroy_at_exit() -> None:
    """Shut down the group we created before the interpreter tears down.

    Left to C++ static destructors, gloo's communication threads can abort a finished script at exit
    ("terminate called without an active exception"), depending on which rank exits first. Background
    checkpoint writes are joined before atexit handlers run, so nothing is cut short here.
    """
    if dist.is_initialized():
        dist.destroy_process_group()


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
            raise ValueError(
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


@dataclass(frozen=True)
class DetectedCluster:
    """What a standalone strategy works out for itself when Fabric or the Trainer is not there to tell it."""

    environment: ClusterEnvironment
    accelerator: Accelerator
    devices: list[torch.device]
    num_nodes: int


def detect_cluster() -> DetectedCluster:
    """Detect the launcher (torchrun, SLURM, LSF, MPI, else plain ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK``
    variables) and this node's devices.

    Devices per node come from ``LOCAL_WORLD_SIZE`` (torchrun), ``SLURM_NTASKS_PER_NODE``, or else the
    whole world is taken to be on one node. CUDA is used when available, the CPU otherwise.
    """
    environment: ClusterEnvironment | None = None
    for env_cls in (SLURMEnvironment, TorchElasticEnvironment, LSFEnvironment, MPIEnvironment):
        if env_cls.detect():
            environment = env_cls()
            break
    if environment is None:
        # Plain variables (Lightning's own launcher, custom scripts): LightningEnvironment reads the addresses,
        # LOCAL_RANK and NODE_RANK, but not WORLD_SIZE / RANK, which it expects to be told.
        environment = LightningEnvironment()
        environment.set_world_size(int(os.environ.get("WORLD_SIZE", "1")))
        environment.set_global_rank(int(os.environ.get("RANK", "0")))
    world_size = environment.world_size()
    per_node_env = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE")
    per_node = int(per_node_env) if per_node_env else world_size
    if per_node < 1 or world_size % per_node != 0:
        raise ValueError(
            f"Cannot work out the cluster layout: {per_node} processes per node does not divide the world"
            f" size {world_size}. Check LOCAL_WORLD_SIZE / WORLD_SIZE, or pass `parallel_devices` explicitly."
        )
    accelerator: Accelerator
    if torch.cuda.is_available():
        accelerator = CUDAAccelerator()
        devices = [torch.device("cuda", i) for i in range(per_node)]
    else:
        accelerator = CPUAccelerator()
        devices = [torch.device("cpu")] * per_node
    return DetectedCluster(environment, accelerator, devices, world_size // per_node)
