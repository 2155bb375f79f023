"""The examples run as documented (short settings), so the README and the guides stay true."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from harness import free_port

ROOT = Path(__file__).resolve().parents[2]


def run(python: str, *args: str, cwd: Path) -> str:
    """Run a script to completion; return what it printed, stdout then stderr (where warnings go)."""
    # Python's default warning filter, as a user gets it: each warning once per process and code line.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    result = subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def fabric_demo(tmp_path_factory: pytest.TempPathFactory, program_python: str) -> tuple[str, str]:
    """The Fabric demo, short: a first run that checkpoints, then a resumed run (their printed output)."""
    tmp_path = tmp_path_factory.mktemp("fabric_demo")
    script = str(ROOT / "examples/fabric/train_llama.py")
    short = ("--steps", "4", "--save-at", "2", "--checkpoint-dir", str(tmp_path))
    first = run(program_python, script, *short, cwd=tmp_path)
    second = run(program_python, script, *short, "--resume", cwd=tmp_path)
    return first, second


def test_fabric_demo_trains_checkpoints_and_resumes_with_the_same_losses(fabric_demo):
    first, second = fabric_demo
    assert "step   4 | loss" in first and "tokens/s" in first
    assert "resumed from" in second and "matches the first run: True" in second


def test_fabric_demo_on_four_cpu_processes_prints_no_view_warning_and_no_repeated_rng_warning(fabric_demo):
    for output in fabric_demo:
        assert "returned a view tensor" not in output, output[-3000:]
        assert output.count("DTensor random operators may not have complete support") <= 1, output[-3000:]


def test_moe_example_trains_with_expert_parallelism_and_resumes_on_another_expert_layout(tmp_path, program_python):
    script = str(ROOT / "examples/fabric/train_moe.py")
    short = ("--devices", "2", "--steps", "3", "--save-at", "2", "--batch-size", "4", "--checkpoint-dir", str(tmp_path))
    first = run(program_python, script, *short, cwd=tmp_path)  # experts split over both ranks
    # every rank holds all experts
    second = run(program_python, script, *short, "--expert-parallel", "1", "--resume", cwd=tmp_path)
    assert "'expert_parallel': 2" in first and "step   3 | loss" in first and "(aux " in first, first[-3000:]
    assert "tokens per expert in layer 0" in second
    assert "resumed from" in second and "matches the first run: True" in second, second[-3000:]


def test_fsdp1_migration_example_resumes_the_fsdp1_run_with_its_losses(tmp_path, program_python):
    script = str(ROOT / "examples/fsdp1_migration/resume_fsdp1_run.py")
    run(program_python, script, "--phase", "fsdp1", "--dir", str(tmp_path), cwd=tmp_path)
    out = run(program_python, script, "--phase", "modelpar", "--dir", str(tmp_path), cwd=tmp_path)
    assert "on a (1, 2) mesh" in out and "match the FSDP1 run's: True" in out


def test_one_line_switch_example_trains_resumes_and_repeats_its_losses(tmp_path, program_python):
    out = run(
        program_python,
        str(ROOT / "examples/fsdp1_migration/one_line_switch.py"),
        "--out",
        str(tmp_path / "ckpt"),
        cwd=tmp_path,
    )
    assert "FSDP2 units of Llama" in out and "the loaded run repeats the losses: True" in out, out[-3000:]


def test_pipeline_example_trains_at_pp2_and_resumes_at_pp1_with_the_same_losses(tmp_path, program_python):
    script = str(ROOT / "examples/fabric/train_pipeline.py")
    short = ("--devices", "2", "--steps", "4", "--checkpoint-dir", str(tmp_path))  # pp=2 x dp=1, then dp=2
    first = run(program_python, script, *short, cwd=tmp_path)
    second = run(program_python, script, *short, "--pipeline", "1", "--resume", cwd=tmp_path)
    assert "cut into 2 pipeline stages (1F1B, 4 micro-batches)" in first and "step   4 | loss" in first, first[-3000:]
    assert "at pp=1 (mesh {'data_parallel': 2" in second, second[-3000:]
    assert "match the first run: True" in second, second[-3000:]


def test_resume_example_saves_on_sigterm_under_torchrun_and_a_second_run_resumes_from_s3(
    tmp_path, s3_bucket, program_python
):
    script = str(ROOT / "examples/fabric/train_resume.py")
    run_dir = f"{s3_bucket}/runs/demo"
    args = ["--run-dir", run_dir, "--save-every", "5", "--keep-last", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    torchrun = [program_python, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
    first = subprocess.Popen(
        [*torchrun, f"--master-port={free_port()}", script, *args, "--steps", "1000", "--step-seconds", "0.2"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    assert first.stdout is not None
    for line in first.stdout:  # preempted after step 6, as SLURM or a cloud would: torchrun passes it on
        lines.append(line)
        if line.startswith("step    6 |"):
            first.send_signal(signal.SIGTERM)
    first.wait(timeout=120)
    output = "".join(lines)
    saved = re.search(r"Received SIGTERM: saved the checkpoint of step (\d+) to '(\S+)'", output)
    assert first.returncode != 0 and saved, output[-3000:]
    step = int(saved.group(1))
    assert 6 <= step < 1000 and saved.group(2) == f"{run_dir}/step-{step:09d}"
    # Fabric launches its 2 processes
    second = run(program_python, script, *args, "--steps", str(step + 2), cwd=tmp_path)
    assert f"resumed from step {step} in {run_dir}" in second and f"step {step + 2:4d} | loss" in second, second[-3000:]
