"""Run under ``torchrun --max-restarts=1`` by test_checkpoint_run.py: a training loop that resumes by itself.

Trains the tiny Llama for ``STEPS`` steps with the standalone strategy, one deterministic global batch per step,
and saves every 5 steps with :class:`modelpar.checkpoint.RunCheckpoints` into ``<run_dir>`` (a URL or a path).
The first attempt (``TORCHELASTIC_RESTART_COUNT=0``) SIGKILLs rank 1 at the start of step 7; torchrun then
restarts both ranks, which resume from step 5. The attempt that finishes also trains a fresh model for all the
steps without checkpoints, in the same processes: the uninterrupted run the losses are compared with. Each
rank writes ``<out_dir>/attempt<N>-rank<R>.json`` after every step.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for parity and harness

from harness import PG_TIMEOUT
from modelpar import ModelParallelStrategy
from modelpar.checkpoint import RunCheckpoints
from modelpar.plans import parallelize_llama
from parity import adamw, global_batches, lm_loss, reference_model

STEPS = 10
KILL_AT = 7


def train_step(strategy: Any, model: Any, optimizer: Any, step: int) -> float:
    x, y = global_batches(STEPS)[step - 1]
    kw = strategy.distributed_sampler_kwargs
    per = x.shape[0] // kw["num_replicas"]
    rows = slice(kw["rank"] * per, (kw["rank"] + 1) * per)
    loss = lm_loss(model(x[rows]), y[rows])
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(strategy.all_reduce(loss.detach().clone(), reduce_op="mean").item())


def main(out_dir: Path, run_dir: str) -> None:
    faulthandler.dump_traceback_later(90, exit=True)  # a hang fails the test with every thread's stack
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    strategy = ModelParallelStrategy(parallelize_llama, 2, 1, timeout=PG_TIMEOUT)
    strategy.setup_environment()
    rank = dist.get_rank()
    model = strategy.setup_module(reference_model())
    optimizer = adamw(model.parameters(), lr=1e-2)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    run = RunCheckpoints(run_dir, every_n_steps=5, keep_last=2)
    start = run.resume(strategy, state)
    record: dict[str, Any] = {"start": start, "step_in_state": state["step"], "losses": {}}
    out = out_dir / f"attempt{attempt}-rank{rank}.json"
    for step in range(start + 1, STEPS + 1):
        if attempt == 0 and step == KILL_AT and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        record["losses"][step] = train_step(strategy, model, optimizer, step)
        state["step"] = step
        run.maybe_save(strategy, step, state)
        out.write_text(json.dumps(record))
    run.close()
    fresh = strategy.setup_module(reference_model())  # the uninterrupted run
    fresh_opt = adamw(fresh.parameters(), lr=1e-2)
    record["reference"] = {step: train_step(strategy, fresh, fresh_opt, step) for step in range(1, STEPS + 1)}
    out.write_text(json.dumps(record))
    strategy.teardown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
