"""Standalone use under a real ``torchrun``: no Fabric, no Trainer, everything detected by the strategy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from harness import free_port

SCRIPT = Path(__file__).with_name("standalone_script.py")


def _torchrun(out: Path, port: int, nproc: int, nnodes: int = 1, node_rank: int = 0) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--nnodes={nnodes}"]
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


def _results(out: Path, world: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def test_standalone_under_torchrun_detects_environment_and_matches_reference(tmp_path):
    _wait([_torchrun(tmp_path, free_port(), nproc=2)])
    results = _results(tmp_path, 2)
    # one node with two processes: "auto" puts tensor parallelism within the node
    assert all(r["mesh"] == [1, 2] and r["num_nodes"] == 1 for r in results)
    assert all(r["device"] == "cpu" and r["precision"] == "32-true" for r in results)
    assert results[0]["losses"] == results[1]["losses"] and results[0]["losses"][-1] < results[0]["losses"][0]


def test_standalone_on_two_simulated_nodes_resolves_auto_to_2x2(tmp_path):
    port = free_port()
    _wait([_torchrun(tmp_path, port, nproc=2, nnodes=2, node_rank=n) for n in (0, 1)])
    results = _results(tmp_path, 4)
    assert all(r["mesh"] == [2, 2] and r["num_nodes"] == 2 for r in results)
    assert len({tuple(r["losses"]) for r in results}) == 1
