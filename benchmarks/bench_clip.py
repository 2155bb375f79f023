"""Gradient clipping by norm: modelpar's clipping now, as it was before batching, and torch's own.

    .venv/bin/python benchmarks/bench_clip.py                               # plain tensors, one process
    .venv/bin/torchrun --nproc-per-node=2 benchmarks/bench_clip.py          # FSDP2 on a 1-D gloo mesh

The model is many small independent ``nn.Linear`` layers (``--layers 500`` gives 1000 parameter tensors):
per-tensor overhead, not arithmetic, is what batching removes. Under ``torchrun`` the model is ``fully_shard``-ed on a
1-D mesh of all ranks, the one layout ``torch.nn.utils.clip_grad_norm_`` also handles. The three
implementations alternate within each repeat (their order rotating), so drift in a shared machine's speed
hits all alike. Each repeat gives each one's median over ``--calls`` calls (under ``torchrun``: on the
slowest rank); the table shows the median over repeats, and each ratio as the median (and range) of the
per-repeat ratios (both sides of each measured in the same repeat).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate

from modelpar import clip_grad_norm


# -- modelpar's clip_grad_norm before batching (fp64 copy and one norm per tensor), frozen for comparison ----
def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _without_partial(grad: torch.Tensor) -> torch.Tensor:
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        placements = [Replicate() if p.is_partial() else p for p in grad.placements]
        return grad.redistribute(grad.device_mesh, placements)
    return grad


def _distinct_shards(grad: torch.Tensor) -> int:
    if not isinstance(grad, DTensor):
        return 1
    mesh = grad.device_mesh
    return math.prod(mesh.size(i) for i, p in enumerate(grad.placements) if not p.is_replicate())


def clip_grad_norm_before(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    grads = [p.grad for p in parameters if p.grad is not None]
    device = _local(grads[0]).device
    world = dist.get_world_size() if dist.is_initialized() else 1
    whole = [_without_partial(g) for g in grads]
    local_norms = torch.stack([torch.linalg.vector_norm(_local(g).double(), norm_type).to(device) for g in whole])
    if math.isinf(norm_type):
        acc = local_norms.max()
    else:
        weights = torch.tensor([_distinct_shards(g) / world for g in whole], dtype=torch.float64, device=device)
        acc = (local_norms.pow(norm_type) * weights).sum()
    if world > 1:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM)
    total = (acc if math.isinf(norm_type) else acc.pow(1.0 / norm_type)).to(_local(grads[0]).dtype)
    if not torch.isfinite(total):
        raise RuntimeError("non-finite norm")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            local = _local(g)
            local.mul_(coef.to(local.dtype))
    return total


# ---------------------------------------------------------------------------------------------------------
class Wide(nn.Module):
    """Many small independent layers: every gradient has a realistic size (none vanishes down a deep chain)."""

    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([layer(x).square().mean() for layer in self.layers]).sum()


def build(layers: int, dim: int, distributed: bool) -> nn.Module:
    """The model with gradients from one backward (under FSDP2: sharded gradients as FSDP2 makes them)."""
    torch.manual_seed(0)
    model = Wide(layers, dim)
    if distributed:
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    model(torch.randn(8, dim)).backward()
    return model


def run(impls: dict[str, Callable[[], Any]], calls: int, repeats: int, distributed: bool) -> dict[str, list[float]]:
    """Per repeat, each implementation's median seconds per call (under torchrun: on the slowest rank)."""
    for fn in impls.values():  # warm-up
        fn()
    per_repeat: dict[str, list[float]] = {name: [] for name in impls}
    names = list(impls)
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            times = []
            for _ in range(calls):
                if distributed:
                    dist.barrier()
                start = time.perf_counter()
                impls[name]()
                times.append(time.perf_counter() - start)
            worst = torch.tensor([statistics.median(times)], dtype=torch.float64)
            if distributed:
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            per_repeat[name].append(float(worst))
    return per_repeat


def ratio(t: dict[str, list[float]], a: str, b: str) -> str:
    """Median and range over repeats of ``a / b``, both sides of each measured in the same repeat."""
    rs = sorted(x / y for x, y in zip(t[a], t[b], strict=True))
    return f"{statistics.median(rs):.2f} ({rs[0]:.2f}-{rs[-1]:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=500)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--norm-type", type=float, default=2.0)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
        torch.set_num_threads(1)  # one process per core
    model = build(args.layers, args.dim, distributed)
    params = list(model.parameters())
    p = args.norm_type
    impls: dict[str, Callable[[], Any]] = {
        "torch": lambda: torch.nn.utils.clip_grad_norm_(params, 1e-3, p),
        "before": lambda: clip_grad_norm_before(params, 1e-3, p),
        "now": lambda: clip_grad_norm(params, 1e-3, p),
    }
    t = run(impls, args.calls, args.repeats, distributed)
    if not distributed or dist.get_rank() == 0:
        where = f"FSDP2 on a 1-D mesh of {dist.get_world_size()} gloo processes" if distributed else "plain tensors"
        print(
            f"\n{len(params)} parameter tensors ({args.layers} x Linear({args.dim}, {args.dim})), {where},"
            f" norm {p}; medians of {args.calls} calls x {args.repeats} interleaved repeats\n"
        )
        print("| torch ms | before ms | now ms | now / before | now / torch | before / torch |")
        print("| --- | --- | --- | --- | --- | --- |")
        ms = {name: f"{statistics.median(v) * 1e3:.2f}" for name, v in t.items()}
        print(
            f"| {ms['torch']} | {ms['before']} | {ms['now']} | {ratio(t, 'now', 'before')}"
            f" | {ratio(t, 'now', 'torch')} | {ratio(t, 'before', 'torch')} |"
        )
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
