"""The Hugging Face fine-tuning examples run as documented, on 4 CPU processes, and export loadable folders."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("pytorch_lightning")
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]


def run(python: str, *args: str, cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "default"}
    result = subprocess.run([python, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def weights(folder: Path) -> dict[str, object]:
    with safe_open(folder / "model.safetensors", framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118  (safe_open has no __iter__)


def test_fabric_and_trainer_examples_fine_tune_a_tiny_llama_and_moe_and_export_what_they_trained(
    tmp_path, program_python
):
    tiny, moe = tmp_path / "tiny", tmp_path / "moe"
    steps = ("--steps", "2", "--seq-len", "16")
    # The Fabric example fine-tunes a mixture of experts, its experts over 2 expert ranks (x 2 tensor-parallel).
    fabric_out = run(
        program_python,
        str(ROOT / "examples/hf/finetune_fabric.py"), "--make-tiny", str(moe), "--moe", "--expert-parallel", "2",
        "--out", str(tmp_path / "f"), *steps,
        cwd=tmp_path,
    )  # fmt: skip
    assert "wrote a tiny random Qwen3-MoE" in fabric_out and "step   2 | loss" in fabric_out
    trainer_out = run(
        program_python,
        str(ROOT / "examples/hf/finetune_trainer.py"), "--make-tiny", str(tiny), "--out", str(tmp_path / "t"), *steps,
        cwd=tmp_path,
    )  # fmt: skip
    assert "finished at step 2" in trainer_out
    for output, folder, source, architecture in (
        (fabric_out, tmp_path / "f", moe, "Qwen3MoeForCausalLM"),
        (trainer_out, tmp_path / "t", tiny, "LlamaForCausalLM"),
    ):
        assert "from_pretrained(out) reproduces the trained model's logits: True" in output, output[-3000:]
        assert json.loads((folder / "config.json").read_text())["architectures"] == [architecture]
        pretrained, exported = weights(source), weights(folder)
        assert sorted(exported) == sorted(pretrained)
        assert not all(exported[k].equal(pretrained[k]) for k in pretrained)  # type: ignore[attr-defined]


def test_long_context_example_fine_tunes_with_context_parallelism_and_matches_one_process(tmp_path, program_python):
    out = run(
        program_python,
        str(ROOT / "examples/hf/finetune_long_context.py"), "--make-tiny", str(tmp_path / "tiny"), "--devices", "2",
        "--seq-len", "256", "--steps", "2",
        cwd=tmp_path,
    )  # fmt: skip
    assert "'context_parallel': 2" in out and "step   2 | loss" in out
    assert "the sharded loss equals one process's on the whole sequence: True" in out, out[-3000:]
