"""``RunCheckpoints`` on real processes: retention, skipping incomplete checkpoints, resuming, restarts.

Spawn 1 (2 processes, gloo, the session's S3 server): retention keeps exactly k, in a local folder (distributed
format through the strategy, full format through a ``Checkpointer``) and at an ``s3://`` URL, and removes what
interrupted saves left; ``latest`` skips a partial remote prefix, a local ``.partial-`` leftover and a folder
without ``.metadata``, warning on rank 0 only; ``resume`` restores the weights and the step. The Trainer's
``ModelCheckpoint`` with an ``s3://`` dirpath keeps its top k there and resumes from it. Then one real
``torchrun --max-restarts=1`` whose first attempt is killed at step 7: the restart resumes from step 5 and
reproduces an uninterrupted run's losses bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from harness import PG_TIMEOUT, free_port, run_distributed
from modelpar import ModelParallelStrategy
from modelpar.checkpoint import Checkpointer, RunCheckpoints
from modelpar.checkpoint._remote import to_location
from modelpar.plans import parallelize_llama
from parity import adamw, full, global_batches, lm_loss, reference_model
from trainer_module import GLOBAL_BATCH, lightning, loader, quiet_trainer

SCRIPT = Path(__file__).with_name("resume_script.py")
STEPS = 8


def _train(strategy: Any, model: Any, optimizer: Any, step: int) -> None:
    x, y = global_batches(STEPS)[step - 1]
    kw = strategy.distributed_sampler_kwargs
    per = x.shape[0] // kw["num_replicas"]
    rows = slice(kw["rank"] * per, (kw["rank"] + 1) * per)
    lm_loss(model(x[rows]), y[rows]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {name: full(p).detach().clone() for name, p in model.named_parameters()}


def _names(where: str) -> list[str]:
    location = to_location(where)
    return sorted(entry.name for entry in location.iterdir())


def case_retention_and_resume(strategy: Any, where: str, saver: str, full_format: bool) -> dict[str, Any]:
    """Train 8 steps saving every 2 (keep 2) after planting a stale leftover; then plant newer incomplete
    checkpoints and resume a fresh model."""
    rank0 = dist.get_rank() == 0
    location = to_location(where)
    if rank0:  # what an interrupted save of step 1 left
        if isinstance(location, Path):
            (location / ".step-000000001.partial-0123456789ab").mkdir(parents=True)
        else:
            (location / "step-000000001" / ".modelpar-writing").write_bytes(b"{}")
    dist.barrier()
    model = strategy.setup_module(reference_model())
    optimizer = adamw(model.parameters(), lr=1e-2)
    use = Checkpointer() if saver == "checkpointer" else strategy
    run = RunCheckpoints(where, every_n_steps=2, keep_last=2, full=full_format)
    saved = []
    for step in range(1, STEPS + 1):
        _train(strategy, model, optimizer, step)
        saved.append(run.maybe_save(use, step, {"model": model, "optimizer": optimizer, "step": step}))
    run.close()
    dist.barrier()
    out: dict[str, Any] = {"saved": saved, "kept": _names(where) if rank0 else None}
    final = _weights(model)
    if rank0:  # newer, incomplete ones that `latest` must skip
        if isinstance(location, Path):
            (location / ".step-000000010.partial-0123456789ab").mkdir()
            (location / "step-000000009").mkdir()
            (location / "step-000000009" / "meta.pt").write_bytes(b"")
        else:
            (location / "step-000000009" / ".modelpar-writing").write_bytes(b"{}")
            (location / "step-000000009" / "__0_0.distcp").write_bytes(b"half")
    dist.barrier()
    fresh = strategy.setup_module(reference_model(seed=1))
    fresh_opt = adamw(fresh.parameters(), lr=1e-2)
    state = {"model": fresh, "optimizer": fresh_opt, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["resumed"] = run.resume(use, state)
    out["warnings"] = [str(w.message) for w in caught if "Skipping" in str(w.message)]
    out["step_in_state"] = state["step"]
    out["same_weights"] = all(torch.equal(final[n], w) for n, w in _weights(fresh).items())
    out["latest"] = str(run.latest()[1])  # type: ignore[index]
    return out


def case_trainer_model_checkpoint_at_url(bucket: str) -> dict[str, Any]:
    """``ModelCheckpoint(dirpath="s3://...", save_top_k=2)`` with our Trainer strategy, then a resume from there."""
    from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

    L = lightning()
    dirpath = f"{bucket}/trainer"
    checkpoint = L.ModelCheckpoint(dirpath=dirpath, monitor="step", mode="max", save_top_k=2, every_n_train_steps=1)
    strategy = TrainerStrategy(1, 2, timeout=PG_TIMEOUT)
    trainer = quiet_trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=4, callbacks=[checkpoint], enable_checkpointing=True
    )
    trainer.fit(L.LlamaModule(), loader(GLOBAL_BATCH))
    dist.barrier()
    kept = _names(dirpath) if dist.get_rank() == 0 else None
    markers = [_names(f"{dirpath}/{name}") for name in kept] if kept else None
    again = quiet_trainer(
        accelerator="cpu", devices=2, strategy=TrainerStrategy(1, 2, timeout=PG_TIMEOUT), max_epochs=5
    )
    again.fit(L.LlamaModule(), loader(GLOBAL_BATCH), ckpt_path=checkpoint.best_model_path)
    return {"kept": kept, "markers": markers, "best": checkpoint.best_model_path, "resumed_to": again.global_step}


def grid(root: Path, bucket: str) -> dict[str, Any]:
    strategy = ModelParallelStrategy(parallelize_llama, 1, 2, timeout=PG_TIMEOUT)
    strategy.setup_environment()
    return {
        "local_dist": case_retention_and_resume(strategy, str(root / "dist"), "strategy", False),
        "local_full": case_retention_and_resume(strategy, str(root / "full"), "checkpointer", True),
        "remote_dist": case_retention_and_resume(strategy, f"{bucket}/run", "strategy", False),
        "trainer": case_trainer_model_checkpoint_at_url(bucket),
    }


@pytest.fixture(scope="module")
def spawn(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> list[dict[str, Any]]:
    return run_distributed(grid, 2, tmp_path_factory.mktemp("run"), s3_server.new_bucket())


def test_retention_keeps_exactly_k_latest_skips_incomplete_and_resume_restores_locally_and_at_a_url(spawn):
    results = spawn
    for key in ("local_dist", "local_full", "remote_dist"):
        r0, r1 = results[0][key], results[1][key]
        assert r0["saved"] == [False, True] * 4, key
        assert r0["kept"] == ["step-000000006", "step-000000008"], (key, r0["kept"])  # and the stale leftover gone
        for r in (r0, r1):
            assert r["resumed"] == 8 and r["step_in_state"] == 8 and r["same_weights"], (key, r)
            assert r["latest"].endswith("/step-000000008"), (key, r["latest"])
        assert r1["warnings"] == [], key  # rank 0 warns, once per entry skipped
        assert any("step-000000009" in w for w in r0["warnings"]), (key, r0["warnings"])
        if key == "remote_dist":
            assert "interrupted" in r0["warnings"][0] and "commit marker" in r0["warnings"][0]
        else:
            assert any(".metadata" in w for w in r0["warnings"]) and any(".partial-" in w for w in r0["warnings"])


def test_model_checkpoint_with_an_s3_dirpath_keeps_top_k_there_and_resumes_from_it(spawn):
    trainer = spawn[0]["trainer"]
    assert trainer["kept"] == ["epoch=2-step=3.ckpt", "epoch=3-step=4.ckpt"], trainer["kept"]
    assert all(".modelpar-complete" in names and ".metadata" in names for names in trainer["markers"])
    assert trainer["best"].startswith("s3://") and trainer["best"].endswith("epoch=3-step=4.ckpt")
    assert trainer["resumed_to"] == 5


def test_a_run_killed_at_step_7_under_torchrun_restarts_from_step_5_with_bit_identical_losses(
    tmp_path, s3_bucket, program_python
):
    cmd = [program_python, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1"]
    cmd += ["--monitor-interval=0.2", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    cmd += [str(SCRIPT), str(tmp_path), f"{s3_bucket}/run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    first = json.loads((tmp_path / "attempt0-rank0.json").read_text())
    second = [json.loads((tmp_path / f"attempt1-rank{r}.json").read_text()) for r in (0, 1)]
    assert first["start"] == 0 and sorted(first["losses"]) == [str(s) for s in range(1, 7)]  # killed at step 7
    reference = second[0]["reference"]
    for record in second:
        assert record["start"] == 5 and record["step_in_state"] == 5
        assert list(record["losses"]) == [str(s) for s in range(6, 11)]
        assert record["losses"] == {s: reference[s] for s in record["losses"]}  # bit-identical, not close
    assert first["losses"] == {s: reference[s] for s in first["losses"]}
    assert _names(f"{s3_bucket}/run") == ["step-000000005", "step-000000010"]
