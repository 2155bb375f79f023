"""Mixed-precision and gradient-accumulation benchmark: FSDP2's bf16 policy vs autocast, one model, one run.

    .venv/bin/torchrun --nproc-per-node=4 benchmarks/bench_precision.py [--dim 1024 --tables precision --malloc fixed]

A Llama-style model is sharded over all ranks (mesh 4 x 1: pure FSDP, no tensor parallelism, where the
mixed-precision policy decides what every all-gather and reduce-scatter carries). Four set-ups run forward,
backward and an AdamW step on the same data:

* modelpar, ``precision="bf16-mixed"``: the strategy derives ``MixedPrecisionPolicy(bf16, fp32)`` and turns
  autocast off (the plan, ``parallelize_llama``, passes ``**fsdp_kwargs(device_mesh)`` to ``fully_shard``);
* modelpar, ``"bf16-mixed"`` with ``mixed_precision=MixedPrecisionPolicy()``: autocast only, FSDP2 in fp32;
* Lightning's ``ModelParallelStrategy``, ``"bf16-mixed"``, same plan: autocast only (on a mesh that no modelpar
  strategy registered, ``fsdp_kwargs`` returns FSDP2's defaults, i.e. what a plain ``fully_shard`` does);
* raw torch: ``fully_shard(..., mp_policy=MixedPrecisionPolicy(bf16, fp32))`` per block, and on the root with
  ``output_dtype=torch.float32`` (fp32 logits, as modelpar's derived policy gives), no Lightning.

A second table runs modelpar in fp32 with 4 micro-batches per step under ``fabric.no_backward_sync``, with
``gradient_accumulation="sharded"`` (reduce-scatter every micro-batch) and ``"unsharded"`` (reduce once).

Per set-up, after ``--warmup`` steps: the median wall time of ``--steps`` steps (slowest rank per step); then,
over ``--memory-steps`` more, the peak resident memory added during a step on the worst rank: the kernel's
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs`` just before the step, after
``malloc_trim(0)`` has handed the heap's free pages back) minus the resident memory at the start. No file is
mapped during a step, so this is anonymous memory, as the process really grows: live tensors plus what
malloc cannot reuse (glibc serves tensors below its adaptive mmap threshold, up to 32 MiB, from its heap).
``--malloc fixed`` pins that threshold at 256 KiB, so that nearly every tensor is its own mapping and the peak
approaches the live tensor bytes (what a GPU's ``max_memory_allocated`` would show), at the price of a page
fault per page of every new tensor: its step times are not representative. Collective traffic is counted in
one last step under a dispatch mode that sees the ``c10d`` ops: the unsharded bytes of every all-gather (its
output) and reduce-scatter (its input) per rank.
Set-ups alternate ``--repeats`` times, so drift in the machine's speed hits all alike; rank 0 prints markdown
tables with medians and ratios (modelpar's default / other: below 1 is better for modelpar's default).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

from modelpar import MESH_AXES, ModelParallelStrategy
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import parallelize_llama

BF16_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ROOT_POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
MIB = 1024 * 1024
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
_M_MMAP_THRESHOLD = -3


# -- memory ----------------------------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def start_peak() -> int:
    """Trim malloc's heap, reset the high-water mark; the resident bytes now (the step's baseline)."""
    gc.collect()
    _LIBC.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current VmRSS
    return _status_kib("VmRSS") * 1024


def peak_added(base: int) -> int:
    return _status_kib("VmHWM") * 1024 - base


# -- collective bytes --------------------------------------------------------------------------------------
class CollectiveBytes(TorchDispatchMode):
    """Unsharded bytes per rank of each kind of ``c10d`` collective dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func._schema.name
        if name.startswith("c10d::"):
            sizes = []  # one total per tensor (or tensor-list) argument; the unsharded side is the largest
            for arg in args:
                tensors = [arg] if isinstance(arg, torch.Tensor) else arg if isinstance(arg, list) else []
                sizes.append(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))
            kind = "all-gather" if "allgather" in name else "reduce-scatter" if "reduce_scatter" in name else name
            self.bytes[kind] += max(sizes, default=0)
        return func(*args, **(kwargs or {}))


# -- steps -----------------------------------------------------------------------------------------------
def batch(step: int, cfg: LlamaConfig, args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of the global batch for ``step`` (every rank is a data-parallel rank on a 4 x 1 mesh)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    per = args.batch // dist.get_world_size()
    rows = tokens[dist.get_rank() * per : (dist.get_rank() + 1) * per]
    return rows[:, :-1], rows[:, 1:]


def make_step(
    model: Any,
    optimizer: Any,
    backward: Callable[[Any], None],
    cfg: LlamaConfig,
    args: Any,
    no_sync: Callable[[bool], Any] | None = None,
) -> Callable[[], None]:
    """Forward, backward and AdamW step; with ``no_sync``, ``args.micro_batches`` forward/backward passes first."""
    counter = [0]
    micro = args.micro_batches if no_sync is not None else 1

    def step() -> None:
        for i in range(micro):
            x, y = batch(counter[0], cfg, args)
            counter[0] += 1
            last = i == micro - 1
            if no_sync is None:
                logits = model(x)
                backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)))
                continue
            with no_sync(not last):
                logits = model(x)
                backward(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)) / micro)
        optimizer.step()
        optimizer.zero_grad()

    return step


def worst(value: float) -> float:
    out = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(out, op=dist.ReduceOp.MAX)
    return float(out)


def measure(step: Callable[[], None], args: Any) -> dict[str, Any]:
    """Median step seconds (slowest rank per step), median peak added bytes (worst rank), collective bytes."""
    for _ in range(args.warmup):  # AdamW's state is created in the first step
        step()
    times, peaks = [], []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        times.append(worst(time.perf_counter() - start))
    for _ in range(args.memory_steps):
        base = start_peak()
        dist.barrier()
        step()
        peaks.append(worst(peak_added(base)))
    counter = CollectiveBytes()
    with counter:
        step()
    return {"step": statistics.median(times), "peak": statistics.median(peaks), "bytes": dict(counter.bytes)}


def run_fabric(strategy: Any, precision: str, cfg: LlamaConfig, args: Any, accumulate: bool = False) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(), strategy=strategy, precision=precision)
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(Llama(cfg))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    no_sync = (lambda skip: fabric.no_backward_sync(model, enabled=skip)) if accumulate else None
    return measure(make_step(model, optimizer, fabric.backward, cfg, args, no_sync), args)


def run_raw(cfg: LlamaConfig, args: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=MESH_AXES)
    torch.manual_seed(0)
    model = Llama(cfg)
    for block in model.layers:
        fully_shard(block, mesh=mesh["data_parallel"], mp_policy=BF16_POLICY)
    fully_shard(model, mesh=mesh["data_parallel"], mp_policy=ROOT_POLICY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return measure(make_step(model, optimizer, lambda loss: loss.backward(), cfg, args), args)


def alternate(runners: dict[str, Callable[[], dict[str, Any]]], repeats: int) -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runners}
    for i in range(repeats):  # alternate (and reverse the order every other time), so drift hits all alike
        for name in list(runners) if i % 2 == 0 else list(runners)[::-1]:
            results[name].append(runners[name]())
            gc.collect()
    return results


def table(results: dict[str, list[dict[str, Any]]], reference: str, header: str) -> None:
    step = {n: statistics.median(r["step"] for r in rs) for n, rs in results.items()}
    peak = {n: statistics.median(r["peak"] for r in rs) / MIB for n, rs in results.items()}
    print(f"| {header} | step s | step ratio | peak MiB | memory ratio | all-gather MiB | reduce-scatter MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, rs in results.items():
        traffic = rs[-1]["bytes"]
        gathered, scattered = traffic.get("all-gather", 0) / MIB, traffic.get("reduce-scatter", 0) / MIB
        others = {k: v for k, v in traffic.items() if k not in ("all-gather", "reduce-scatter")}
        extra = "".join(f" (+ {k} {v / MIB:.1f} MiB)" for k, v in others.items())
        print(
            f"| {name} | {step[name]:.3f} | {step[reference] / step[name]:.2f} | {peak[name]:.0f}"
            f" | {peak[reference] / max(peak[name], 1.0):.2f} | {gathered:.0f} | {scattered:.0f}{extra} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=4, help="global batch (rows), split over the ranks")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="measured steps per set-up and repeat")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--memory-steps", type=int, default=2, help="steps measured for memory, after the timed ones")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, default=4, help="per step, in the accumulation table")
    parser.add_argument("--tables", default="precision,accumulation", help="which tables, comma-separated")
    parser.add_argument(
        "--malloc",
        choices=("fixed", "default"),
        default="default",
        help="'fixed': peaks near live tensor bytes, but slow steps (see the module docstring)",
    )
    args = parser.parse_args()
    if args.malloc == "fixed":
        _LIBC.mallopt(_M_MMAP_THRESHOLD, 256 * 1024)  # freed tensors leave the process, see the docstring
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if args.batch % world:
        parser.error(f"--batch {args.batch} must be a multiple of the world size {world}")
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=16,
        n_kv_heads=8,
        ffn_hidden=args.dim * 3,
        max_seq_len=args.seq,
    )
    load_before = os.getloadavg()[0]

    def modelpar(**kw: Any) -> ModelParallelStrategy:
        return ModelParallelStrategy(parallelize_llama, world, 1, **kw)

    def lightning() -> LightningStrategy:
        return LightningStrategy(parallelize_llama, world, 1)

    autocast = MixedPrecisionPolicy()
    runners: dict[str, dict[str, Callable[[], dict[str, Any]]]] = {
        "precision": {
            "modelpar, bf16 policy (default)": lambda: run_fabric(modelpar(), "bf16-mixed", cfg, args),
            "modelpar, autocast": lambda: run_fabric(modelpar(mixed_precision=autocast), "bf16-mixed", cfg, args),
            "Lightning, autocast": lambda: run_fabric(lightning(), "bf16-mixed", cfg, args),
            "raw torch, bf16 policy": lambda: run_raw(cfg, args),
        },
        "accumulation": {
            '"sharded"': lambda: run_fabric(modelpar(gradient_accumulation="sharded"), "32-true", cfg, args, True),
            '"unsharded"': lambda: run_fabric(modelpar(gradient_accumulation="unsharded"), "32-true", cfg, args, True),
        },
    }
    tables = [t.strip() for t in args.tables.split(",") if t.strip()]
    if unknown := [t for t in tables if t not in runners]:
        parser.error(f"unknown tables {unknown}; choose from {list(runners)}")
    results = {t: alternate(runners[t], args.repeats) for t in tables}
    load_after = os.getloadavg()[0]
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in Llama(cfg).parameters())
        print(
            f"\nmodel {params / 1e6:.1f}M parameters ({params * 4 / MIB:.0f} MiB fp32), global batch {args.batch} x"
            f" {args.seq} tokens, mesh {world}x1, {world} CPU processes (gloo), torch {torch.__version__};"
            f" medians over {args.steps} timed and {args.memory_steps} memory steps x {args.repeats} repeats, malloc"
            f" {args.malloc}; 1-minute load average {load_before:.1f}"
            f" before, {load_after:.1f} after\n"
        )
        if "precision" in results:
            print(
                'precision="bf16-mixed" (ratios: modelpar default / this; traffic: unsharded MiB per rank per step)\n'
            )
            table(results["precision"], "modelpar, bf16 policy (default)", "bf16-mixed")
        if "accumulation" in results:
            print(
                f'\ngradient accumulation, modelpar, "32-true", {args.micro_batches} micro-batches of the global batch'
                ' per step (ratios: "sharded" / this)\n'
            )
            table(results["accumulation"], '"sharded"', "gradient_accumulation")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
