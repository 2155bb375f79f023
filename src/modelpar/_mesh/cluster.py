"""Which launcher started this process, and the cluster it describes: for standalone use (``torchrun``, ``srun``,
``jsrun``, ``mpirun``), where no Lightning launcher chose a cluster environment.

Written against Lightning's public cluster-environment classes (one private check overridden, in
``_SrunEnvironment``), so a plain script and the strategies read the same environment the same way.
"""

from __future__ import annotations

import importlib
import os
import re
import socket
from collections import Counter
from dataclasses import dataclass

import torch
from lightning_fabric.accelerators import Accelerator, CPUAccelerator, CUDAAccelerator
from lightning_fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from typing_extensions import override

__all__ = [
    "DetectedCluster",
    "LauncherEnvironment",
    "cuda_device_index",
    "detect_cluster",
    "uniform_tasks_per_node",
]


@dataclass(frozen=True)
class DetectedCluster:
    """What a standalone strategy works out for itself when Fabric or the Trainer is not there to tell it.

    ``devices`` holds one entry per process on this node, indexed by local rank (``devices[local_rank]`` is this
    process's device), and ``num_nodes * len(devices)`` is the world size. ``per_node_known`` is ``False`` when no
    variable said how many processes share a node: the layout is then described as one node of all processes,
    and ``"auto"`` mesh sizes must be refused (``MeshLayout.resolve(..., per_node_known=False)``).
    """

    environment: ClusterEnvironment
    accelerator: Accelerator
    devices: list[torch.device]
    num_nodes: int
    per_node_known: bool = True


#: What ``mpirun``/``mpiexec`` set in each process, as (world size, rank, processes on this node, rank on this
#: node): Open MPI (also IBM Spectrum MPI), then MPICH and Intel MPI (Hydra).
_MPI_VARIABLES = (
    ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"),
)


class LauncherEnvironment(ClusterEnvironment):
    """Ranks that a launcher assigned and left in variables (``mpirun``/``mpiexec`` without mpi4py, custom scripts).

    The rendezvous is ``MASTER_ADDR`` (default ``127.0.0.1``) and ``MASTER_PORT``. Like torchrun's environment it
    ignores ``set_world_size`` / ``set_global_rank``: the launcher knows the ranks already.
    """

    def __init__(self, *, world_size: int, global_rank: int, local_rank: int, node_rank: int) -> None:
        self._world_size, self._global_rank = world_size, global_rank
        self._local_rank, self._node_rank = local_rank, node_rank

    @property
    @override
    def creates_processes_externally(self) -> bool:
        return True

    @property
    @override
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    @override
    def main_port(self) -> int:
        port = os.environ.get("MASTER_PORT")
        if port is None:
            raise ValueError(
                f"{self._world_size} processes were started without MASTER_PORT, so they cannot meet. Set"
                " MASTER_ADDR (the first host) and MASTER_PORT (a free port) in every process, e.g. `mpirun -x"
                " MASTER_ADDR=node0 -x MASTER_PORT=29500 ...`, or install mpi4py to have them exchanged over MPI."
            )
        return int(port)

    @staticmethod
    @override
    def detect() -> bool:
        return False  # built by detect_cluster from the variables, never picked by Lightning's connector

    @override
    def world_size(self) -> int:
        return self._world_size

    @override
    def set_world_size(self, size: int) -> None:
        pass  # the launcher's value stands

    @override
    def global_rank(self) -> int:
        return self._global_rank

    @override
    def set_global_rank(self, rank: int) -> None:
        pass  # the launcher's value stands

    @override
    def local_rank(self) -> int:
        return self._local_rank

    @override
    def node_rank(self) -> int:
        return self._node_rank


class _SrunEnvironment(SLURMEnvironment):
    """Lightning's SLURM environment, also for ``srun --ntasks=N`` without ``--ntasks-per-node``.

    Lightning refuses that form because its ``devices=`` must match a per-node count; standalone, the count is
    read from ``SLURM_TASKS_PER_NODE`` (``"4(x2)"``) instead, or recorded as unknown. This overrides Lightning's
    private check: should it be renamed, Lightning's own error (asking for ``--ntasks-per-node``) comes back.
    """

    @staticmethod
    @override
    def _validate_srun_variables() -> None:
        pass


def uniform_tasks_per_node(spec: str) -> int | None:
    """The count in SLURM's ``SLURM_TASKS_PER_NODE`` form (``"4"``, ``"4(x2)"``, ``"4(x2),4"``) if every node has
    the same, else ``None`` (``"2(x3),1"``, or anything unparsable)."""
    counts = set()
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x\d+\))?\s*", part)
        if match is None:
            return None
        counts.add(int(match.group(1)))
    return counts.pop() if len(counts) == 1 else None


def _uniform_per_node(hosts: list[str], world_size: int) -> int | None:
    """Entries per host if every host has as many and together they are the world, else ``None``."""
    counts = set(Counter(hosts).values())
    if len(counts) != 1:
        return None
    per_host = counts.pop()
    return per_host if per_host * len(set(hosts)) == world_size else None


def _launcher() -> tuple[ClusterEnvironment, int | None, str]:
    """This process's launcher: its environment, processes per node where a variable tells (else ``None``), and
    where that count came from (for error messages). The launcher closest to the process wins."""
    if TorchElasticEnvironment.detect():  # torchrun, even inside a SLURM or LSF job
        return TorchElasticEnvironment(), None, "LOCAL_WORLD_SIZE"
    if LSFEnvironment.detect():  # jsrun; it also sets OMPI_COMM_WORLD_*, so before mpirun
        lsf = LSFEnvironment()
        for name in ("JSM_NAMESPACE_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            if name in os.environ:
                return lsf, int(os.environ[name]), name
        # As Lightning reads it: one line per slot, the launch node first (not a compute host). Slots may
        # outnumber tasks, so the count is used only if the hosts' slots add up to the world size.
        with open(os.environ["LSB_DJOB_RANKFILE"]) as f:
            hosts = [line.strip() for line in f if line.strip()][1:]
        return lsf, _uniform_per_node(hosts, lsf.world_size()), "LSB_DJOB_RANKFILE"
    for names in _MPI_VARIABLES:  # mpirun/mpiexec, even inside a SLURM allocation (whose SLURM_* are the batch's)
        if all(name in os.environ for name in names):
            size, rank, local_size, local_rank = (int(os.environ[name]) for name in names)
            if MPIEnvironment.detect():  # mpi4py: the address and port are exchanged over MPI
                return MPIEnvironment(), local_size, names[2]
            node_rank = rank // local_size if local_size > 0 else 0  # mpirun fills a node before the next
            ranks = {"world_size": size, "global_rank": rank, "local_rank": local_rank, "node_rank": node_rank}
            return LauncherEnvironment(**ranks), local_size, names[2]
    if SLURMEnvironment.detect():
        if "SLURM_NTASKS_PER_NODE" in os.environ:
            return _SrunEnvironment(), int(os.environ["SLURM_NTASKS_PER_NODE"]), "SLURM_NTASKS_PER_NODE"
        for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            if name in os.environ:
                return _SrunEnvironment(), uniform_tasks_per_node(os.environ[name]), name
        return _SrunEnvironment(), None, "SLURM_NTASKS_PER_NODE"
    if MPIEnvironment.detect():  # another MPI, through mpi4py: count processes per host name (a collective)
        mpi = MPIEnvironment()
        hosts = importlib.import_module("mpi4py.MPI").COMM_WORLD.allgather(socket.gethostname())
        return mpi, _uniform_per_node(hosts, mpi.world_size()), "the MPI host names"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        single = LightningEnvironment()
        single.set_global_rank(int(os.environ.get("RANK", "0")))
        return single, None, "LOCAL_WORLD_SIZE"
    # Plain variables. Without a per-node count the processes are described as one node, as before.
    per_node = int(os.environ["LOCAL_WORLD_SIZE"]) if "LOCAL_WORLD_SIZE" in os.environ else None
    span = per_node or world_size
    given, local = os.environ.get("RANK"), os.environ.get("LOCAL_RANK")
    node = os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK"))
    global_rank = int(given) if given is not None else int(node or 0) * span + int(local or 0)
    plain = LauncherEnvironment(
        world_size=world_size,
        global_rank=global_rank,
        local_rank=int(local) if local is not None else global_rank % span,
        node_rank=int(node) if node is not None else global_rank // span,
    )
    return plain, per_node, "LOCAL_WORLD_SIZE"


def cuda_device_index(visible: int, local_rank: int, per_node: int | None) -> int:
    """The CUDA ordinal for the process of ``local_rank``, given the ``visible`` devices (``torch.cuda.device_count()``)
    and the processes on its node (``None``: unknown).

    One visible device: ordinal 0, whatever the local rank (the launcher gave each task its own GPU, e.g. through
    ``CUDA_VISIBLE_DEVICES``). At least one device per process on the node: the local rank. Anything else is
    ambiguous and raises a ``ValueError`` (with a known ``per_node``, identically on every rank of the node).
    """
    if visible == 1:
        return 0
    if visible > 1 and (visible >= per_node if per_node is not None else local_rank < visible):
        return local_rank
    if per_node is None:
        problem = f"local rank {local_rank} sees {visible} CUDA device(s) and no variable says how many processes"
        problem += " share its node"
    else:
        problem = f"{per_node} processes share this node but each sees {visible} CUDA device(s)"
    raise ValueError(
        f"Cannot pick a GPU: {problem} (`torch.cuda.device_count()`={visible}). Give each process exactly one"
        " GPU (e.g. `CUDA_VISIBLE_DEVICES` per task, SLURM `--gpus-per-task=1`), start at most one process per"
        " visible GPU, or pass `parallel_devices` explicitly."
    )


def detect_cluster() -> DetectedCluster:
    """Work out the launcher, the processes per node and this process's device, for standalone use.

    Launchers, the one closest to the process first:

    * torchrun (per node: ``LOCAL_WORLD_SIZE``), also inside a SLURM or LSF job;
    * LSF ``jsrun`` (Lightning's ``LSFEnvironment``; per node: ``JSM_NAMESPACE_LOCAL_SIZE``, else the hosts in
      ``LSB_DJOB_RANKFILE`` if their slots add up to the world size);
    * ``mpirun``/``mpiexec``: Open MPI's ``OMPI_COMM_WORLD_*``, MPICH's and Intel MPI's ``PMI_RANK``/``PMI_SIZE``/
      ``MPI_LOCALNRANKS``/``MPI_LOCALRANKID``, also inside a SLURM allocation. With mpi4py this is Lightning's
      ``MPIEnvironment``; without, ``MASTER_ADDR``/``MASTER_PORT`` must be set;
    * ``srun`` (per node: ``SLURM_NTASKS_PER_NODE``, else ``SLURM_STEP_TASKS_PER_NODE``/``SLURM_TASKS_PER_NODE``
      such as ``"4(x2)"`` if every node has as many; ``srun --ntasks`` alone is accepted, unlike in Lightning);
    * other MPI launches through mpi4py (per node: processes per host name);
    * plain ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``/``NODE_RANK`` (per node: ``LOCAL_WORLD_SIZE``), or one process.

    ``LOCAL_WORLD_SIZE``, where set, is the per-node count whatever the launcher. Where nothing gives it and there is
    more than one process, ``per_node_known`` is ``False`` and all processes are described as one node, so that
    ``"auto"`` sizes are refused rather than spreading tensor parallelism across nodes unnoticed.

    The device is the CPU without CUDA; with CUDA see :func:`cuda_device_index` (``cuda:0`` when each process sees
    one GPU, ``cuda:<local rank>`` when the node's GPUs are all visible).
    """
    environment, per_node, source = _launcher()
    if "LOCAL_WORLD_SIZE" in os.environ:  # torchrun's, or the user's answer where the launcher gives none
        per_node, source = int(os.environ["LOCAL_WORLD_SIZE"]), "LOCAL_WORLD_SIZE"
    world_size = environment.world_size()
    per_node_known = per_node is not None or world_size == 1
    if per_node is None:
        per_node = world_size
    if per_node < 1 or world_size % per_node != 0:
        raise ValueError(
            f"Cannot work out the cluster layout: {per_node} processes per node ({source}) does not divide the world"
            f" size {world_size}. Check {source} and the world size, or pass `parallel_devices` explicitly."
        )
    accelerator: Accelerator
    if torch.cuda.is_available():
        accelerator = CUDAAccelerator()
        visible = torch.cuda.device_count()
        if per_node_known:
            indices = [cuda_device_index(visible, i, per_node) for i in range(per_node)]
        else:
            indices = [cuda_device_index(visible, environment.local_rank(), None)] * per_node
        devices = [torch.device("cuda", i) for i in indices]
    else:
        accelerator = CPUAccelerator()
        devices = [torch.device("cpu")] * per_node
    return DetectedCluster(environment, accelerator, devices, world_size // per_node, per_node_known)
