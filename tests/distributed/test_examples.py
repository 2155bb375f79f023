"""The examples run as documented (short settings), so the README and the guides stay true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path) -> str:
    """Run a script to completion; return what it printed, stdout then stderr (where warnings go)."""
    # Python's default warning filter, as a user gets it: each warning once per process and code line.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def fabric_demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """The Fabric demo, short: a first run that checkpoints, then a resumed run (their printed output)."""
    tmp_path = tmp_path_factory.mktemp("fabric_demo")
    script = str(ROOT / "examples/fabric/train_llama.py")
    first = run(script, "--steps", "4", "--save-at", "2", "--checkpoint-dir", str(tmp_path), cwd=tmp_path)
    second = run(script, "--steps", "4", "--save-at", "2", "--checkpoint-dir", str(tmp_path), "--resume", cwd=tmp_path)
    return first, second


def test_fabric_demo_trains_checkpoints_and_resumes_with_the_same_losses(fabric_demo):
    first, second = fabric_demo
    assert "step   4 | loss" in first and "tokens/s" in first
    assert "resumed from" in second and "matches the first run: True" in second


def test_fabric_demo_on_four_cpu_processes_prints_no_view_warning_and_no_repeated_rng_warning(fabric_demo):
    for output in fabric_demo:
        assert "returned a view tensor" not in output, output[-3000:]
        assert output.count("DTensor random operators may not have complete support") <= 1, output[-3000:]


def test_fsdp1_migration_example_resumes_the_fsdp1_run_with_its_losses(tmp_path):
    script = str(ROOT / "examples/fsdp1_migration/resume_fsdp1_run.py")
    run(script, "--phase", "fsdp1", "--dir", str(tmp_path), cwd=tmp_path)
    out = run(script, "--phase", "modelpar", "--dir", str(tmp_path), cwd=tmp_path)
    assert "on a (1, 2) mesh" in out and "match the FSDP1 run's: True" in out
