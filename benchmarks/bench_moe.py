"""Mixture-of-experts training step: expert parallelism vs FSDP alone, vs Lightning's strategy and raw torch.

    .venv/bin/torchrun --nproc-per-node=2 benchmarks/bench_moe.py [--experts 8 --dim 256 --steps 10]
    .venv/bin/torchrun --nproc-per-node=2 benchmarks/bench_moe.py --accelerator cuda   # one GPU per process

One model, the MoE variant of ``modelpar.models.Llama`` (every block a MoE, top-2, dropless), trained with AdamW
on the same data by four runners in one run, alternating: raw torch and Lightning 2.6.6's ``ModelParallelStrategy``
shard every weight with FSDP over the data-parallel ranks (the experts like any weight: Lightning has no expert
parallelism), modelpar with ``LLAMA_MOE_PLAN`` at ``expert_parallel_size=1`` (the same, plus the router statistics
summed over the ranks) and at ``expert_parallel_size=N`` (each rank holds ``E / N`` whole experts, tokens by
all-to-all). Rank 0 prints a markdown table: median step seconds on the slowest rank, tokens/s, and ratios.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_train_step import timed  # median seconds per call on the slowest rank (the benchmarks' one timer)
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard

from modelpar import ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_MOE_PLAN


def batch(step: int, cfg: LlamaConfig, args: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    per = args.batch // dist.get_world_size()
    rows = tokens[dist.get_rank() * per : (dist.get_rank() + 1) * per].to(device)
    return rows[:, :-1], rows[:, 1:]


def train_step(model: Any, optimizer: Any, backward: Callable[[Any], None], cfg: LlamaConfig, args: Any) -> Any:
    counter = [0]
    device = next(model.parameters()).device

    def step() -> None:
        x, y = batch(counter[0], cfg, args, device)
        counter[0] += 1
        logits = model(x)
        aux = getattr(model, "aux_loss", None)
        if aux is None and hasattr(model, "module"):
            aux = model.module.aux_loss
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)) + aux
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()

    return step


def fsdp_only(model: torch.nn.Module, device_mesh: DeviceMesh) -> torch.nn.Module:
    """A Lightning-style ``parallelize_fn``: FSDP over the data-parallel ranks, experts sharded like any weight."""
    mesh = device_mesh["data_parallel"] if device_mesh.mesh_dim_names else device_mesh
    for block in model.layers:  # type: ignore[union-attr]
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def run_raw(cfg: LlamaConfig, args: Any) -> float:
    device = torch.device(args.accelerator, dist.get_rank() if args.accelerator == "cuda" else 0)
    mesh = init_device_mesh(args.accelerator, (dist.get_world_size(),))
    torch.manual_seed(0)
    model = fsdp_only(Llama(cfg).to(device), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return timed(train_step(model, optimizer, lambda loss: loss.backward(), cfg, args), args.steps)


def run_fabric(strategy: Any, cfg: LlamaConfig, args: Any) -> float:
    fabric = Fabric(accelerator=args.accelerator, devices=dist.get_world_size(), strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Llama(cfg))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return timed(train_step(model, optimizer, fabric.backward, cfg, args), args.steps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--moe-hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks")
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
        n_experts=args.experts,
        top_k=args.top_k,
        moe_hidden=args.moe_hidden,
    )
    dist.init_process_group("nccl" if args.accelerator == "cuda" else "gloo")
    world = dist.get_world_size()
    runners: dict[str, Callable[[], float]] = {
        "raw torch (FSDP)": lambda: run_raw(cfg, args),
        "Lightning (FSDP)": lambda: run_fabric(LightningStrategy(fsdp_only, world, 1), cfg, args),
        "modelpar ep=1": lambda: run_fabric(ModelParallelStrategy(LLAMA_MOE_PLAN, world, 1), cfg, args),
        f"modelpar ep={world}": lambda: run_fabric(
            ModelParallelStrategy(LLAMA_MOE_PLAN, world, 1, expert_parallel_size=world), cfg, args
        ),
    }
    results: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(args.repeats):  # alternate, so drift in the machine's speed hits all alike
        for name, run in runners.items():
            results[name].append(run())
    if dist.get_rank() == 0:
        step = {name: statistics.median(times) for name, times in results.items()}
        tokens = args.batch * args.seq
        params = sum(p.numel() for p in Llama(cfg).parameters())
        print(
            f"\nMoE Llama {params / 1e6:.1f}M parameters ({args.experts} experts, top-{args.top_k}, {args.layers}"
            f" MoE layers), global batch {args.batch} x {args.seq} tokens, {world} {args.accelerator} processes;"
            f" medians over {args.steps} steps x {args.repeats}\n"
        )
        print("| | step s | tokens/s | step vs raw torch | step vs Lightning | step vs modelpar ep=1 |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in runners:
            print(
                f"| {name} | {step[name]:.3f} | {tokens / step[name]:.0f} | {step[name] / step['raw torch (FSDP)']:.3f}"
                f" | {step[name] / step['Lightning (FSDP)']:.3f} | {step[name] / step['modelpar ep=1']:.3f} |"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
