"""Training-step benchmark: modelpar vs Lightning's ModelParallelStrategy vs raw torch, one model, one run.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/bench_train_step.py [--dim 512 --layers 4 --steps 10]

All three shard the same Llama-style model with the same plan (``parallelize_llama``) on a 2 x 2 mesh and run
forward, backward and an AdamW step on the same data; the strategies add only their own overhead. Also
measured: global gradient-norm clipping, which ``torch.nn.utils.clip_grad_norm_`` (raw torch, and
Lightning's ``fabric.clip_gradients``) cannot do on a model whose gradients live on two meshes.
Rank 0 prints a markdown table with medians and ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy
from torch.distributed.device_mesh import init_device_mesh

from modelpar import MESH_AXES, ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama


def batch(step: int, cfg: LlamaConfig, batch_size: int, seq: int, dp_rank: int, dp: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq + 1), generator=g)
    per = batch_size // dp
    rows = tokens[dp_rank * per : (dp_rank + 1) * per]
    return rows[:, :-1], rows[:, 1:]


def timed(fn: Callable[[], Any], steps: int, warmup: int = 2) -> float:
    """Median seconds per call on the slowest rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


def make_step(model: Any, optimizer: Any, backward: Callable[[Any], None], cfg: LlamaConfig, args: Any) -> Any:
    counter = [0]
    dp_rank, dp = dist.get_rank() // 2, 2

    def step() -> None:
        x, y = batch(counter[0], cfg, args.batch, args.seq, dp_rank, dp)
        counter[0] += 1
        logits = model(x)
        backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()

    return step


def run_raw(cfg: LlamaConfig, args: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=MESH_AXES)
    torch.manual_seed(0)
    model = parallelize_llama(Llama(cfg), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {"step": timed(make_step(model, optimizer, lambda loss: loss.backward(), cfg, args), args.steps)}
    model(batch(0, cfg, args.batch, args.seq, dist.get_rank() // 2, 2)[0]).float().mean().backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        out["clip"] = timed(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0), args.steps)
    except Exception as err:  # gradients on two meshes
        out["clip"] = f"fails: {type(err).__name__}"
    return out


def run_fabric(strategy: Any, cfg: LlamaConfig, args: Any) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Llama(cfg))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    out: dict[str, Any] = {"step": timed(make_step(model, optimizer, fabric.backward, cfg, args), args.steps)}
    fabric.backward(model(batch(0, cfg, args.batch, args.seq, dist.get_rank() // 2, 2)[0]).float().mean())
    try:
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        out["clip"] = timed(lambda: fabric.clip_gradients(model, optimizer, max_norm=1.0), args.steps)
    except Exception as err:
        out["clip"] = f"fails: {type(err).__name__}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        ffn_hidden=args.dim * 3,
        max_seq_len=args.seq,
    )
    dist.init_process_group("gloo")
    runners: dict[str, Callable[[], dict[str, Any]]] = {
        "raw torch": lambda: run_raw(cfg, args),
        "Lightning": lambda: run_fabric(LightningStrategy(parallelize_llama, 2, 2), cfg, args),
        "modelpar": lambda: run_fabric(ModelParallelStrategy(parallelize_llama, 2, 2), cfg, args),
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for _ in range(args.repeats):  # alternate, so drift in the machine's speed hits all three alike
        for name, run in runners.items():
            results[name].append(run())
    if dist.get_rank() == 0:
        step = {n: statistics.median(r["step"] for r in rs) for n, rs in results.items()}
        tokens = args.batch * args.seq
        params = sum(p.numel() for p in Llama(cfg).parameters())
        print(
            f"\nmodel {params / 1e6:.1f}M parameters, global batch {args.batch} x {args.seq} tokens, mesh 2x2,"
            f" {dist.get_world_size()} CPU processes (gloo); medians over {args.steps} steps x {args.repeats}\n"
        )
        print("| | step s | tokens/s | step vs raw torch | step vs Lightning | clip by norm s |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in runners:
            clips = [r["clip"] for r in results[name]]
            clip = clips[0] if isinstance(clips[0], str) else f"{statistics.median(clips):.4f}"
            print(
                f"| {name} | {step[name]:.3f} | {tokens / step[name]:.0f} | {step[name] / step['raw torch']:.3f}"
                f" | {step[name] / step['Lightning']:.3f} | {clip} |"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
