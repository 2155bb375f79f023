"""Standalone use under a real ``torchrun``: no Fabric, no Trainer, everything detected by the strategy."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from harness import free_port, run_distributed

SCRIPT = Path(__file__).with_name("standalone_script.py")


def _torchrun(
    python: str, out: Path, port: int, nproc: int, nnodes: int = 1, node_rank: int = 0
) -> subprocess.Popen[str]:
    cmd = [python, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
    cmd += [f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}", str(SCRIPT), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait(procs: list[subprocess.Popen[str]], timeout: float = 240) -> None:
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    failed = [o for p, o in zip(procs, outputs, strict=True) if p.returncode != 0]
    assert not failed, "torchrun failed:\n" + "\n".join(o[-4000:] for o in failed)
    # The script ends right after a collective (standalone_script._end_right_after_a_collective): no abort at exit.
    assert not any("terminate called" in o for o in outputs), "\n".join(o[-4000:] for o in outputs)


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_standalone_under_torchrun_detects_environment_and_matches_reference(tmp_path, program_python):
    _wait([_torchrun(program_python, tmp_path, free_port(), nproc=2)])
    results = _results(tmp_path, 2)
    # one node with two processes: "auto" puts tensor parallelism within the node
    assert all(r["mesh"] == [1, 2] and r["num_nodes"] == 1 for r in results)
    assert all(r["device"] == "cpu" and r["precision"] == "32-true" for r in results)
    assert results[0]["losses"] == results[1]["losses"] and results[0]["losses"][-1] < results[0]["losses"][0]
    assert all(r["pipeline_err"] < 1e-5 for r in results)  # pp=2 standalone: pipeline_step as under Fabric


def test_standalone_on_two_simulated_nodes_resolves_auto_to_2x2(tmp_path, program_python):
    port = free_port()
    _wait([_torchrun(program_python, tmp_path, port, nproc=2, nnodes=2, node_rank=n) for n in (0, 1)])
    results = _results(tmp_path, 4)
    assert all(r["mesh"] == [2, 2] and r["num_nodes"] == 2 for r in results)
    assert len({tuple(r["losses"]) for r in results}) == 1
    assert all(r["pipeline_err"] < 1e-5 for r in results)  # pp=2 across the two nodes, FSDP over 2 within each


def case_launcher_without_per_node_counts(sizes: tuple[Any, Any]) -> dict[str, Any]:
    """Like mpirun without Open MPI's variables: WORLD_SIZE/RANK only, so nobody knows processes per node."""
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK"):
        os.environ.pop(name, None)
    from harness import PG_TIMEOUT
    from modelpar import MeshSizeError, ModelParallelStrategy
    from modelpar.plans import parallelize_llama

    strategy = ModelParallelStrategy(parallelize_llama, *sizes, timeout=PG_TIMEOUT)
    try:
        strategy.setup_environment()
    except MeshSizeError as err:
        return {"error": str(err)}
    return {"mesh": list(strategy.device_mesh.shape)}


def test_auto_sizes_are_refused_on_every_rank_when_no_launcher_variable_gives_the_processes_per_node():
    results = run_distributed(case_launcher_without_per_node_counts, 2, ("auto", "auto"))
    assert results[0] == results[1] and "error" in results[0]
    assert "per node" in results[0]["error"] and "tensor_parallel_size" in results[0]["error"]


def test_explicit_sizes_work_when_the_processes_per_node_are_unknown():
    results = run_distributed(case_launcher_without_per_node_counts, 2, (2, 1))
    assert [r["mesh"] for r in results] == [[2, 1], [2, 1]]
