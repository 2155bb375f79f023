"""The examples run as documented (short settings), so the README and the guides stay true."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def test_fabric_demo_trains_checkpoints_and_resumes_with_the_same_losses(tmp_path):
    script = str(ROOT / "examples/fabric/train_llama.py")
    first = run(script, "--steps", "4", "--save-at", "2", "--checkpoint-dir", str(tmp_path), cwd=tmp_path)
    assert "step   4 | loss" in first and "tokens/s" in first
    second = run(script, "--steps", "4", "--save-at", "2", "--checkpoint-dir", str(tmp_path), "--resume", cwd=tmp_path)
    assert "resumed from" in second and "matches the first run: True" in second


def test_fsdp1_migration_example_resumes_the_fsdp1_run_with_its_losses(tmp_path):
    script = str(ROOT / "examples/fsdp1_migration/resume_fsdp1_run.py")
    run(script, "--phase", "fsdp1", "--dir", str(tmp_path), cwd=tmp_path)
    out = run(script, "--phase", "modelpar", "--dir", str(tmp_path), cwd=tmp_path)
    assert "on a (1, 2) mesh" in out and "match the FSDP1 run's: True" in out
