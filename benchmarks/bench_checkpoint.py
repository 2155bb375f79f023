"""Checkpoint benchmark: modelpar vs Lightning's ModelParallelStrategy, same models, same run, two sizes.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/bench_checkpoint.py [--sizes small,large --load-repeats 7]

For each model size (``small``: a Llama-style model of about 34M parameters, ``large``: about 134M), both
strategies shard the model 2 (data) x 2 (tensor); both stay set up side by side while their operations
take turns (the strategy that goes first alternates), so a change in the machine's load hits both alike.
Per operation it measures the wall time (slowest rank) and the peak *anonymous* resident memory added on
the worst rank (sampled every millisecond from /proc/self/status; file-backed pages of memory-mapped
checkpoints are reclaimable and not counted):

* distributed save and load (model + AdamW state),
* loading a full single-file model state into the sharded model (``fabric.load_raw``),
* with modelpar, how long an ``async_save=True`` save blocks the training loop (after one warm-up save,
  which also creates the background process group and thread), and for the full format the peak memory an
  asynchronous save adds until written, against the size of the state (about 1x: gathered once, not restaged).

One unmeasured save and load per strategy come first (lazy set-up), then medians are reported. Rank 0
prints a markdown table per size with modelpar / Lightning ratios (below 1 is better for modelpar), then a
summary of the ratios, and the 1-minute load average before and after each size (the run's own 4 processes
count in it from the first size on): on a shared machine, compare runs made at similar load. ``--max-load``
waits (up to ``--wait`` seconds) for the load average to drop below it before the first size.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
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

SIZES = {
    "small": {"dim": 512, "layers": 8, "vocab": 8192},  # 33.6M parameters
    "large": {"dim": 1024, "layers": 8, "vocab": 16384},  # 134.2M parameters
}
NAMES = ("lightning", "modelpar")


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


def config(dim: int, layers: int, vocab: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab, dim=dim, n_layers=layers, n_heads=16, n_kv_heads=8, ffn_hidden=dim * 3, max_seq_len=64
    )


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


def load_average(max_load: float = float("inf"), deadline: float = 0.0) -> tuple[float, bool]:
    """Rank 0's 1-minute load average, and whether to go on (below ``max_load`` or past ``deadline``)."""
    load = os.getloadavg()[0]
    value = torch.tensor([load, float(load <= max_load or time.monotonic() >= deadline)], dtype=torch.float64)
    dist.broadcast(value, src=0)  # rank 0 decides for all, so every rank leaves the waiting loop together
    return float(value[0]), bool(value[1])


def wait_for_quiet(max_load: float, wait_s: float) -> float:
    """Sleep until the 1-minute load average is below ``max_load`` (at most ``wait_s``); return it."""
    deadline = time.monotonic() + wait_s
    load, go = load_average(max_load, deadline)
    while not go:
        time.sleep(5)
        load, go = load_average(max_load, deadline)
    return load


def bench_size(
    cfg: LlamaConfig, root: Path, repeats: int, load_repeats: int
) -> dict[str, dict[str, list[tuple[float, int]]]]:
    """Samples per strategy and operation; the two strategies take turns, each going first every other time."""
    full_file = root / "full-model.pt"
    if dist.get_rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(1)
        torch.save(Llama(cfg).state_dict(), full_file)
    dist.barrier()
    makers: dict[str, Callable[[], Any]] = {
        "lightning": lambda: LightningStrategy(parallelize_llama, 2, 2),
        "modelpar": lambda: ModelParallelStrategy(parallelize_llama, 2, 2),
    }
    built = {name: build(make(), cfg) for name, make in makers.items()}
    samples: dict[str, dict[str, list[tuple[float, int]]]] = {name: {} for name in NAMES}

    def take_turns(op: str, times: int, fn: Callable[[Fabric, Any, Any, Path], Any]) -> None:
        for i in range(times):
            for name in NAMES if i % 2 == 0 else NAMES[::-1]:
                args = (*built[name], root / f"{name}-dist")
                samples[name].setdefault(op, []).append(measure(functools.partial(fn, *args)))

    take_turns("warm-up", 1, lambda f, m, o, p: f.save(p, {"model": m, "optimizer": o, "step": 1}))
    take_turns("warm-up", 1, lambda f, m, o, p: f.load(p, {"model": m, "optimizer": o}))
    take_turns("save", repeats, lambda f, m, o, p: f.save(p, {"model": m, "optimizer": o, "step": 1}))
    take_turns("load", load_repeats, lambda f, m, o, p: f.load(p, {"model": m, "optimizer": o}))
    take_turns("load_full_file", repeats, lambda f, m, o, p: f.load_raw(full_file, m))
    built.clear()

    fabric_async, model_a, optimizer_a = build(ModelParallelStrategy(parallelize_llama, 2, 2, async_save=True), cfg)
    apath = root / "modelpar-async"
    checkpointer = fabric_async.strategy._core.checkpointer
    fabric_async.save(apath, {"model": model_a, "optimizer": optimizer_a})  # warm-up: creates group + thread
    checkpointer.wait()
    for _ in range(repeats):
        blocking = measure(lambda: fabric_async.save(apath, {"model": model_a, "optimizer": optimizer_a}))
        samples["modelpar"].setdefault("async_blocking", []).append(blocking)
        samples["modelpar"].setdefault("async_total", []).append(measure(checkpointer.wait))
    fabric_async.strategy.teardown()

    # The full format, asynchronously: rank 0 gathers the full state to its CPU memory; the peak added memory
    # shows whether it is staged (copied) once more for the background write.
    fabric_full, model_f, optimizer_f = build(
        ModelParallelStrategy(parallelize_llama, 2, 2, async_save=True, save_distributed_checkpoint=False), cfg
    )
    fpath = root / "modelpar-async-full.pt"
    full_checkpointer = fabric_full.strategy._core.checkpointer

    def save_full_and_wait() -> None:
        fabric_full.save(fpath, {"model": model_f, "optimizer": optimizer_f})
        full_checkpointer.wait()

    save_full_and_wait()  # warm-up
    for _ in range(repeats):
        samples["modelpar"].setdefault("async_full", []).append(measure(save_full_and_wait))
    fabric_full.strategy.teardown()
    return samples


def report(label: str, n_params: int, samples: dict[str, dict[str, list[tuple[float, int]]]]) -> dict[str, float]:
    def med(name: str, key: str, idx: int) -> float:
        return statistics.median(s[idx] for s in samples[name][key])

    mb = 1024 * 1024
    n_load, n_save = len(samples["modelpar"]["load"]), len(samples["modelpar"]["save"])
    print(
        f"\n### {label}: {n_params / 1e6:.1f}M parameters ({n_params * 4 / mb:.0f} MiB fp32, plus AdamW state x2),"
        f" median of {n_load} loads and {n_save} of everything else\n"
    )
    header = ["operation", "Lightning s", "modelpar s", "time ratio"]
    header += ["Lightning peak MiB", "modelpar peak MiB", "memory ratio"]
    print("| " + " | ".join(header) + " |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    ratios = {}
    for key in ("save", "load", "load_full_file"):
        lt, mt = med("lightning", key, 0), med("modelpar", key, 0)
        lm, mm = med("lightning", key, 1) / mb, med("modelpar", key, 1) / mb
        ratios[key] = mt / lt
        print(f"| {key} | {lt:.3f} | {mt:.3f} | {mt / lt:.2f} | {lm:.0f} | {mm:.0f} | {mm / max(lm, 1):.2f} |")
    sync = med("modelpar", "save", 0)
    blocking = med("modelpar", "async_blocking", 0)
    ratios["async_blocking"] = blocking / sync
    print(
        f"\nmodelpar async save: blocks {blocking:.3f} s vs {sync:.3f} s synchronous"
        f" ({blocking / sync:.2f} of it); background completion {med('modelpar', 'async_total', 0):.3f} s more"
    )
    state_mib = n_params * 4 * 3 / mb  # weights + AdamW's two moments, fp32
    full_peak = med("modelpar", "async_full", 1) / mb
    ratios["async_full_memory"] = full_peak / state_mib
    print(
        f"modelpar async save, full format: {med('modelpar', 'async_full', 0):.3f} s to written, peak added memory"
        f" {full_peak:.0f} MiB on the worst rank for a {state_mib:.0f} MiB state ({full_peak / state_mib:.2f}x)"
    )
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="small,large", help=f"comma-separated, from {list(SIZES)}")
    parser.add_argument("--repeats", type=int, default=5, help="saves, full-file loads and async saves")
    parser.add_argument("--load-repeats", type=int, default=7, help="distributed loads per strategy")
    parser.add_argument("--max-load", type=float, default=None, help="wait for a lower 1-minute load average")
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait at most for --max-load")
    args = parser.parse_args()
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        parser.error(f"unknown sizes {unknown}; choose from {list(SIZES)}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    holder = [tempfile.mkdtemp(prefix="bench-ckpt-") if rank == 0 else None]
    dist.broadcast_object_list(holder)
    base = Path(str(holder[0]))

    summary = []
    for i, label in enumerate(sizes):
        cfg = config(**SIZES[label])
        quiet = args.max_load is not None and i == 0  # later sizes see this run's own load, not only others'
        before = wait_for_quiet(args.max_load, args.wait) if quiet else load_average()[0]
        samples = bench_size(cfg, base / label, args.repeats, args.load_repeats)
        after = load_average()[0]
        if rank == 0:
            shutil.rmtree(base / label, ignore_errors=True)
        if rank == 0:
            n_params = sum(p.numel() for p in Llama(cfg).parameters())
            ratios = report(label, n_params, samples)
            print(f"\n1-minute load average: {before:.2f} before, {after:.2f} after")
            summary.append((label, n_params, ratios, before, after))
        dist.barrier()

    if rank == 0:
        print(
            f"\n### Summary: modelpar / Lightning, mesh 2x2 on {dist.get_world_size()} CPU processes (gloo),"
            f" torch {torch.__version__}\n"
        )
        print(
            "| model | load | save | load_full_file | async save blocks (of sync) | async full: peak memory / state"
            " | load average |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for label, n_params, r, before, after in summary:
            print(
                f"| {label}, {n_params / 1e6:.1f}M | {r['load']:.2f} | {r['save']:.2f} | {r['load_full_file']:.2f}"
                f" | {r['async_blocking']:.2f} | {r['async_full_memory']:.2f} | {before:.1f} -> {after:.1f} |"
            )
        shutil.rmtree(base, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
