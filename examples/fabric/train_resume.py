"""A training loop that resumes by itself: checkpoints every N steps into a run folder, local or in object storage.

Fabric with ``modelpar.ModelParallelStrategy`` trains a small Llama-style model; ``RunCheckpoints`` saves
``step-<N>`` checkpoints into ``--run-dir`` every ``--save-every`` steps, keeps the last ``--keep-last`` complete
ones (older ones are deleted in the background), and at start resumes from the newest complete one. On SIGTERM
or SIGUSR1 (a preemption notice) it saves the current step and exits. The data of a step is a pure function of
the step, so a resumed run continues exactly where the interrupted one left off.

Locally, on 2 CPU processes::

    python examples/fabric/train_resume.py --run-dir runs/demo --steps 20
    python examples/fabric/train_resume.py --run-dir runs/demo --steps 30   # resumes from step 20

In object storage (``pip install 'modelpar[s3]'``), restarted by torchrun after a failure (each restart
resumes from the newest complete checkpoint)::

    export AWS_ENDPOINT_URL=https://s3.example.com   # omit for AWS itself
    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_DEFAULT_REGION=us-east-1
    torchrun --nproc-per-node=2 --max-restarts=3 examples/fabric/train_resume.py --run-dir s3://bucket/runs/demo

Under SLURM, ask for a warning signal before the time limit (``#SBATCH --signal=USR1@120``) and requeue the job:
the next one resumes from the checkpoint saved on the signal.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from lightning_fabric import Fabric

from modelpar import ModelParallelStrategy
from modelpar.checkpoint import RunCheckpoints
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=64)


def batch_for_step(step: int, batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Arithmetic token sequences, a pure function of the step: a resumed run sees the same data."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, CONFIG.vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % CONFIG.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run-dir", required=True, help="a local folder or a URL (s3://bucket/run, gs://...)")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--data-parallel", type=int, default=2)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--keep-last", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, split over data-parallel ranks")
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to try interruptions)")
    args = parser.parse_args()

    strategy = ModelParallelStrategy(parallelize_llama, args.data_parallel, args.tensor_parallel)
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(42)
    with fabric.init_module(empty_init=True):
        model = Llama(CONFIG)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    state = {"model": model, "optimizer": optimizer}

    run = RunCheckpoints(args.run_dir, every_n_steps=args.save_every, keep_last=args.keep_last, save_on_signal=True)
    start = run.resume(fabric, state)  # 0 for a new run
    fabric.print(f"resumed from step {start} in {args.run_dir}" if start else f"new run in {args.run_dir}")

    dp = strategy.distributed_sampler_kwargs  # tensor-parallel peers get the same slice
    per_rank = args.batch_size // dp["num_replicas"]
    rows = slice(dp["rank"] * per_rank, (dp["rank"] + 1) * per_rank)
    for step in range(start + 1, args.steps + 1):
        x, y = batch_for_step(step, args.batch_size, args.seq_len)
        x, y = x[rows].to(fabric.device), y[rows].to(fabric.device)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        fabric.print(f"step {step:4d} | loss {fabric.all_reduce(loss.detach()).item():.4f}")
        time.sleep(args.step_seconds)
        if run.maybe_save(fabric, step, state):  # on a signal: saves this step and raises SystemExit
            fabric.print(f"saved {run.location(step)}")
    run.close()
    fabric.print(f"done: {args.steps} steps")


if __name__ == "__main__":
    main()
