"""Checkpoint benchmark: modelpar vs Lightning's ModelParallelStrategy, same model, same run.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/bench_checkpoint.py [--dim 1024 --layers 8 --repeats 3]

Both strategies shard one Llama-style model 2 (data) x 2 (tensor) and measure, per operation, the wall
time (slowest rank) and the peak *anonymous* resident memory added on the worst rank (sampled every
millisecond from /proc/self/status; file-backed pages of memory-mapped checkpoints are reclaimable and
not counted):

* distributed save and load (model + AdamW state),
* loading a full single-file model state into the sharded model (``fabric.load_raw``),
* with modelpar, how long an ``async_save=True`` save blocks the training loop (after one warm-up save,
  which also creates the background process group and thread).

Repeats alternate between the two strategies; the median is reported. Rank 0 prints a markdown table
with modelpar / Lightning ratios (below 1 is better for modelpar).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy

from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama


def anon_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def measure(fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds on the slowest rank, peak added anonymous RSS on the worst rank) for a collective ``fn``."""
    dist.barrier()
    base = anon_rss_bytes()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], anon_rss_bytes())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    start = time.perf_counter()
    fn()
    elapsed = time.perf_counter() - start
    stop.set()
    sampler.join()
    peak[0] = max(peak[0], anon_rss_bytes())
    stats = torch.tensor([elapsed, float(peak[0] - base)], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return float(stats[0]), int(stats[1])


def build(strategy: Any, cfg: LlamaConfig) -> tuple[Fabric, Any, Any]:
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size() if dist.is_initialized() else 4, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Llama(cfg))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    fabric.backward(model(x).float().mean())
    optimizer.step()
    optimizer.zero_grad()
    return fabric, model, optimizer


def run_one(name: str, make: Callable[..., Any], cfg: LlamaConfig, root: Path, full_file: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    fabric, model, optimizer = build(make(), cfg)
    path = root / f"{name}-dist"
    results["save"] = measure(lambda: fabric.save(path, {"model": model, "optimizer": optimizer, "step": 1}))
    results["load"] = measure(lambda: fabric.load(path, {"model": model, "optimizer": optimizer}))
    results["load_full_file"] = measure(lambda: fabric.load_raw(full_file, model))
    if name == "modelpar":
        fabric_async, model_a, optimizer_a = build(make(async_save=True), cfg)
        apath = root / "modelpar-async"
        fabric_async.save(apath, {"model": model_a, "optimizer": optimizer_a})  # warm-up: creates group + thread
        fabric_async.strategy._core.checkpointer.wait()
        results["async_blocking"] = measure(
            lambda: fabric_async.save(apath, {"model": model_a, "optimizer": optimizer_a})
        )
        results["async_total"] = measure(lambda: fabric_async.strategy._core.checkpointer.wait())
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden=args.dim * 3,
        max_seq_len=64,
    )
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tmp = Path(tempfile.mkdtemp(prefix="bench-ckpt-")) if rank == 0 else None
    holder = [str(tmp)]
    dist.broadcast_object_list(holder)
    root = Path(holder[0])
    full_file = root / "full-model.pt"
    if rank == 0:
        torch.manual_seed(1)
        torch.save(Llama(cfg).state_dict(), full_file)
    dist.barrier()
    n_params = sum(p.numel() for p in Llama(cfg).parameters()) if rank == 0 else 0

    makers: dict[str, Callable[..., Any]] = {
        "lightning": lambda: LightningStrategy(parallelize_llama, 2, 2),
        "modelpar": lambda async_save=False: ModelParallelStrategy(parallelize_llama, 2, 2, async_save=async_save),
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in makers}
    for _ in range(args.repeats):
        for name, make in makers.items():
            runs[name].append(run_one(name, make, cfg, root, full_file))

    if rank == 0:

        def med(name: str, key: str, idx: int) -> float:
            return statistics.median(r[key][idx] for r in runs[name])

        mb = 1024 * 1024
        print(
            f"\nmodel: {n_params / 1e6:.1f}M parameters ({n_params * 4 / mb:.0f} MiB fp32, plus AdamW state x2),"
            f" mesh 2x2 on {dist.get_world_size()} CPU processes (gloo), median of {args.repeats}\n"
        )
        header = ["operation", "Lightning s", "modelpar s", "time ratio"]
        header += ["Lightning peak MiB", "modelpar peak MiB", "memory ratio"]
        print("| " + " | ".join(header) + " |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for key in ("save", "load", "load_full_file"):
            lt, mt = med("lightning", key, 0), med("modelpar", key, 0)
            lm, mm = med("lightning", key, 1) / mb, med("modelpar", key, 1) / mb
            print(f"| {key} | {lt:.3f} | {mt:.3f} | {mt / lt:.2f} | {lm:.0f} | {mm:.0f} | {mm / max(lm, 1):.2f} |")
        sync = med("modelpar", "save", 0)
        blocking = med("modelpar", "async_blocking", 0)
        print(
            f"\nmodelpar async save: blocks {blocking:.3f} s vs {sync:.3f} s synchronous"
            f" ({blocking / sync:.2f} of it); background completion {med('modelpar', 'async_total', 0):.3f} s more"
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
