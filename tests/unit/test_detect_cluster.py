"""Standalone cluster detection from launcher variables, and the GPU pick (no process group, no GPU)."""

import os
import socket

import pytest
import torch
from lightning_fabric.plugins.environments import (
    LightningEnvironment,
    LSFEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

from modelpar import MeshLayout
from modelpar._mesh.cluster import (
    LauncherEnvironment,
    cuda_device_index,
    detect_cluster,
    uniform_tasks_per_node,
)

_LAUNCHER_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "LSB_", "JSM_", "TORCHELASTIC_")
_LAUNCHER_NAMES = {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK"}
_LAUNCHER_NAMES |= {"MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    """No launcher variables from the machine running the tests, and none left behind: Lightning's LSF and
    SLURM environments write MASTER_ADDR / MASTER_PORT into os.environ themselves. The tests describe CPU
    runs; the GPU choice is tested through `cuda_device_index`."""
    saved = dict(os.environ)
    for name in list(os.environ):
        if name.startswith(_LAUNCHER_PREFIXES) or name in _LAUNCHER_NAMES:
            monkeypatch.delenv(name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    yield
    os.environ.clear()
    os.environ.update(saved)


def setenv(monkeypatch, **variables):
    for name, value in variables.items():
        monkeypatch.setenv(name, str(value))


def layout(detected):
    """(environment type, world size, global rank, local rank, nodes, processes per node, per node known)."""
    env = detected.environment
    return (
        type(env),
        env.world_size(),
        env.global_rank(),
        env.local_rank(),
        detected.num_nodes,
        len(detected.devices),
        detected.per_node_known,
    )


def test_a_single_process_without_variables_is_one_node_with_one_cpu():
    detected = detect_cluster()
    assert layout(detected) == (LightningEnvironment, 1, 0, 0, 1, 1, True)
    assert detected.devices == [torch.device("cpu")]


def test_torchrun_gives_processes_per_node_through_local_world_size(monkeypatch):
    setenv(monkeypatch, TORCHELASTIC_RUN_ID="x", WORLD_SIZE=8, RANK=5, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    assert layout(detect_cluster()) == (TorchElasticEnvironment, 8, 5, 1, 2, 4, True)


def test_torchrun_inside_a_slurm_job_is_torchrun(monkeypatch):
    setenv(monkeypatch, SLURM_NTASKS=2, SLURM_NTASKS_PER_NODE=1, SLURM_PROCID=1, SLURM_LOCALID=0, SLURM_NODEID=1)
    setenv(monkeypatch, TORCHELASTIC_RUN_ID="x", WORLD_SIZE=8, RANK=5, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4)
    assert layout(detect_cluster()) == (TorchElasticEnvironment, 8, 5, 1, 2, 4, True)


def slurm(monkeypatch, ntasks, procid, localid, nodeid, **more):
    setenv(monkeypatch, SLURM_JOB_ID=1234, SLURM_NTASKS=ntasks, SLURM_PROCID=procid, SLURM_LOCALID=localid)
    setenv(monkeypatch, SLURM_NODEID=nodeid, **more)


def test_slurm_with_ntasks_per_node(monkeypatch):
    slurm(monkeypatch, 8, 6, 2, 1, SLURM_NTASKS_PER_NODE=4, SLURM_TASKS_PER_NODE="4(x2)")
    detected = detect_cluster()
    assert isinstance(detected.environment, SLURMEnvironment)
    assert layout(detected)[1:] == (8, 6, 2, 2, 4, True)


@pytest.mark.parametrize("variable", ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"])
def test_slurm_ntasks_alone_reads_a_uniform_tasks_per_node(monkeypatch, variable):
    slurm(monkeypatch, 8, 6, 2, 1, **{variable: "4(x2)"})  # srun --ntasks=8 --nodes=2: Lightning refuses it
    detected = detect_cluster()
    assert isinstance(detected.environment, SLURMEnvironment)
    assert layout(detected)[1:] == (8, 6, 2, 2, 4, True)


@pytest.mark.parametrize("tasks_per_node", ["2(x3),1", None])
def test_slurm_without_a_uniform_per_node_count_leaves_it_unknown(monkeypatch, tasks_per_node):
    slurm(monkeypatch, 7, 6, 0, 3, **({"SLURM_TASKS_PER_NODE": tasks_per_node} if tasks_per_node else {}))
    detected = detect_cluster()
    assert isinstance(detected.environment, SLURMEnvironment)
    assert layout(detected)[1:] == (7, 6, 0, 1, 7, False)


def test_local_world_size_answers_for_a_launcher_that_does_not_say(monkeypatch):
    slurm(monkeypatch, 8, 6, 2, 1, LOCAL_WORLD_SIZE=4)
    assert layout(detect_cluster())[1:] == (8, 6, 2, 2, 4, True)


@pytest.mark.parametrize(
    ("spec", "expected"),
    [("4", 4), ("4(x2)", 4), ("4(x2),4", 4), ("4,4", 4), ("2(x3),1", None), ("4,2", None), ("", None), ("x", None)],
)
def test_slurm_tasks_per_node_is_a_count_only_when_every_node_has_as_many(spec, expected):
    assert uniform_tasks_per_node(spec) == expected


@pytest.mark.parametrize(
    "names",
    [
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
        ("PMI_SIZE", "PMI_RANK", "MPI_LOCALNRANKS", "MPI_LOCALRANKID"),
    ],
    ids=["open-mpi", "mpich-hydra"],
)
def test_mpirun_variables_give_ranks_and_processes_per_node(monkeypatch, names):
    setenv(monkeypatch, MASTER_ADDR="node0", MASTER_PORT=29500, **dict(zip(names, (8, 6, 4, 2), strict=True)))
    detected = detect_cluster()
    assert layout(detected) == (LauncherEnvironment, 8, 6, 2, 2, 4, True)
    env = detected.environment
    assert (env.node_rank(), env.main_address, env.main_port) == (1, "node0", 29500)
    env.set_global_rank(0), env.set_world_size(4)  # what set_world_ranks does: the launcher's values stand
    assert (env.global_rank(), env.world_size()) == (6, 8)


def test_mpirun_inside_a_slurm_allocation_is_mpirun(monkeypatch):
    slurm(monkeypatch, 2, 0, 0, 0, SLURM_NTASKS_PER_NODE=1)  # the batch step's, inherited by every process
    setenv(monkeypatch, OMPI_COMM_WORLD_SIZE=8, OMPI_COMM_WORLD_RANK=6)
    setenv(monkeypatch, OMPI_COMM_WORLD_LOCAL_SIZE=4, OMPI_COMM_WORLD_LOCAL_RANK=2, MASTER_PORT=29500)
    assert layout(detect_cluster()) == (LauncherEnvironment, 8, 6, 2, 2, 4, True)


def test_mpirun_without_master_port_says_how_to_set_it(monkeypatch):
    setenv(monkeypatch, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_RANK=1)
    setenv(monkeypatch, OMPI_COMM_WORLD_LOCAL_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=1)
    env = detect_cluster().environment
    with pytest.raises(ValueError, match=r"2 processes were started without MASTER_PORT.* `mpirun -x MASTER_ADDR="):
        env.main_port


def lsf(monkeypatch, tmp_path, lines, size, rank, local_rank, **more):
    rankfile = tmp_path / "rankfile"
    rankfile.write_text("".join(f"{line}\n" for line in ["launch-node", *lines]))
    setenv(monkeypatch, LSB_JOBID=4321, LSB_DJOB_RANKFILE=rankfile, JSM_NAMESPACE_SIZE=size)
    setenv(monkeypatch, JSM_NAMESPACE_RANK=rank, JSM_NAMESPACE_LOCAL_RANK=local_rank, **more)


def test_lsf_counts_processes_per_node_in_the_rankfile(monkeypatch, tmp_path):
    host = socket.gethostname()  # Lightning's LSFEnvironment looks this host up in the rankfile
    lsf(monkeypatch, tmp_path, [host, host, "other", "other"], size=4, rank=1, local_rank=1)
    assert layout(detect_cluster()) == (LSFEnvironment, 4, 1, 1, 2, 2, True)


def test_lsf_prefers_jsrun_local_size_to_rankfile_slots(monkeypatch, tmp_path):
    host = socket.gethostname()
    lsf(monkeypatch, tmp_path, [host] * 3 + ["other"] * 3, size=4, rank=1, local_rank=1, JSM_NAMESPACE_LOCAL_SIZE=2)
    assert layout(detect_cluster()) == (LSFEnvironment, 4, 1, 1, 2, 2, True)


def test_lsf_rankfile_slots_that_are_not_the_world_leave_the_count_unknown(monkeypatch, tmp_path):
    host = socket.gethostname()
    lsf(monkeypatch, tmp_path, [host] * 3 + ["other"] * 3, size=4, rank=1, local_rank=1)
    assert layout(detect_cluster()) == (LSFEnvironment, 4, 1, 1, 1, 4, False)


def test_plain_variables_with_local_world_size(monkeypatch):
    setenv(monkeypatch, WORLD_SIZE=4, RANK=3, LOCAL_RANK=1, NODE_RANK=1, LOCAL_WORLD_SIZE=2, MASTER_PORT=29500)
    detected = detect_cluster()
    assert layout(detected) == (LauncherEnvironment, 4, 3, 1, 2, 2, True)
    assert detected.environment.node_rank() == 1


def test_plain_world_size_and_rank_alone_keep_the_rank_but_not_the_per_node_count(monkeypatch):
    setenv(monkeypatch, WORLD_SIZE=4, RANK=3, MASTER_PORT=29500)
    assert layout(detect_cluster()) == (LauncherEnvironment, 4, 3, 3, 1, 4, False)


def test_a_per_node_count_that_does_not_divide_the_world_is_refused(monkeypatch):
    setenv(monkeypatch, WORLD_SIZE=4, RANK=3, LOCAL_WORLD_SIZE=3, MASTER_PORT=29500)
    with pytest.raises(ValueError, match=r"3 processes per node \(LOCAL_WORLD_SIZE\) does not divide the world size 4"):
        detect_cluster()


def resolve(detected, dp, tp):
    """What ParallelCore.setup_distributed does with a standalone strategy's detected values."""
    return MeshLayout.resolve(
        dp,
        tp,
        world_size=detected.environment.world_size(),
        num_nodes=detected.num_nodes,
        devices_per_node=len(detected.devices),
        per_node_known=detected.per_node_known,
    )


def test_auto_sizes_are_refused_when_processes_per_node_are_unknown(monkeypatch):
    setenv(monkeypatch, WORLD_SIZE=8, RANK=0, MASTER_PORT=29500)
    with pytest.raises(ValueError, match=r"the launcher did not say how many of the 8 processes share a node") as e:
        resolve(detect_cluster(), "auto", "auto")
    assert "`tensor_parallel_size=<processes per node>`" in str(e.value)
    assert "set LOCAL_WORLD_SIZE" in str(e.value)


@pytest.mark.parametrize(("dp", "tp", "expected"), [(2, 4, (2, 4)), ("auto", 4, (2, 4)), (4, "auto", (4, 2))])
def test_explicit_sizes_work_when_processes_per_node_are_unknown(monkeypatch, dp, tp, expected):
    setenv(monkeypatch, WORLD_SIZE=8, RANK=0, MASTER_PORT=29500)
    assert resolve(detect_cluster(), dp, tp).shape == expected


def test_auto_sizes_work_for_one_process_even_with_the_count_unknown():
    resolved = MeshLayout.resolve("auto", "auto", world_size=1, num_nodes=1, devices_per_node=1, per_node_known=False)
    assert resolved.shape == (1, 1)


@pytest.mark.parametrize(
    ("visible", "local_rank", "per_node", "expected"),
    [
        (1, 3, 4, 0),  # one GPU per task (CUDA_VISIBLE_DEVICES set per task)
        (1, 0, 1, 0),
        (4, 3, 4, 3),  # the node's GPUs all visible
        (8, 3, 4, 3),
        (1, 5, None, 0),  # per-node count unknown
        (8, 5, None, 5),
    ],
)
def test_the_gpu_is_the_only_visible_one_or_the_local_rank(visible, local_rank, per_node, expected):
    assert cuda_device_index(visible, local_rank, per_node) == expected


def test_fewer_visible_gpus_than_processes_on_the_node_are_refused_on_every_local_rank():
    for local_rank in range(4):
        with pytest.raises(ValueError, match=r"4 processes share this node but each sees 2 CUDA device\(s\)"):
            cuda_device_index(2, local_rank, 4)


def test_a_local_rank_beyond_the_visible_gpus_is_refused_when_the_per_node_count_is_unknown():
    with pytest.raises(ValueError, match=r"local rank 5 sees 4 CUDA device\(s\) and no variable says how many"):
        cuda_device_index(4, 5, None)
