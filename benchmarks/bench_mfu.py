"""Model FLOP utilization on one GPU: modelpar vs Lightning's strategy vs torch's ``fully_shard`` by hand.

    python benchmarks/bench_mfu.py [--layers 16 --dim 2048 --batch 4 --seq 2048 --steps 20]

One process (NCCL, 1x1 mesh) trains a ~1.1B-parameter Llama-style model (``modelpar.models.Llama``: dim 2048,
16 layers, 16 heads, 8 KV heads, SwiGLU 8192, vocabulary 32000) in bf16 with the best single-GPU plan:
selective activation checkpointing, ``torch.compile`` per block, FSDP2's bf16 policy (parameters all-gathered
and computed in bf16, gradients reduced in fp32, fp32 master weights and AdamW). Three variants in one run, on
the same data, one after the other:

* ``modelpar``: ``ModelParallelStrategy(LLAMA_PLAN.replace(activation_checkpointing="selective", compile=True))``
  with ``precision="bf16-mixed"`` (the strategy derives the bf16 policy);
* ``lightning``: Lightning's ``ModelParallelStrategy`` with the same plan (it runs ``"bf16-mixed"`` as autocast
  over fp32 FSDP2 parameters, its documented behaviour);
* ``torch``: the same model sharded by hand: selective checkpointing with ``torch.utils.checkpoint``, ``compile``
  and ``fully_shard`` per block and on the root, with the bf16 ``MixedPrecisionPolicy``.

Reported per variant: tokens/s (median of the timed steps, after warm-up steps that include compilation), and
MFU against the GPU's dense bf16 peak under both FLOP conventions:

* ``6N + 12·L·d·s`` per token, no causal discount (torchtitan, MosaicML): N counts the parameters that take part
  in matrix multiplies (all but the input embedding), L layers, d the model width, s the sequence length;
* ``6N + 6·L·d·s``: the attention term halved for the causal mask (Megatron-LM).

The ratio column is each variant's tokens/s over the hand-written torch run's (our overhead as a ratio). Record
results in ``benchmarks/RESULTS.md`` with the date, GPU and versions.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from modelpar.models import Llama, LlamaConfig

#: CUDA when there is a GPU; on a machine without one the benchmark runs on the CPU as a smoke check of its own
#: code (tiny sizes, --no-compile, --peak-tflops given): its figures then mean nothing.
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

#: Dense bf16 peak (TFLOP/s, no sparsity) by device name; pass --peak-tflops for others.
PEAKS_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "GH200": 989.4, "B200": 2250.0, "A100": 312.0}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--variants", default="modelpar,lightning,torch")
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile (all variants)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not known here")
    return p.parse_args()


def flops_per_token(cfg: LlamaConfig, n_matmul_params: int, seq: int) -> tuple[float, float]:
    """(no causal discount, causal discount): 6N + 12·L·d·s and 6N + 6·L·d·s."""
    attention = 12 * cfg.n_layers * cfg.dim * seq
    return 6 * n_matmul_params + attention, 6 * n_matmul_params + attention / 2


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters of the model minus the input embedding (a lookup, not a matrix multiply) and the norms."""
    with torch.device("meta"):
        model = Llama(cfg)
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("tok_embeddings"))


def peak_flops(args: argparse.Namespace) -> float:
    if args.peak_tflops:
        return args.peak_tflops * 1e12
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU"
    for key, tflops in sorted(PEAKS_TFLOPS.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return tflops * 1e12
    raise SystemExit(f"unknown dense bf16 peak for {name!r}: pass --peak-tflops")


def batches(cfg: LlamaConfig, args: argparse.Namespace, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g).to(DEVICE)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def measure(step: Callable[[torch.Tensor, torch.Tensor], None], data: list[Any], args: argparse.Namespace) -> float:
    """Median seconds per training step over ``args.steps`` timed steps, after ``args.warmup`` untimed ones."""
    for x, y in data[: args.warmup]:
        step(x, y)
    sync()
    times = []
    for x, y in data[args.warmup :]:
        start = time.perf_counter()
        step(x, y)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def plan(args: argparse.Namespace) -> Any:
    from modelpar.plans import LLAMA_PLAN

    return LLAMA_PLAN.replace(activation_checkpointing="selective", compile=not args.no_compile)


def run_fabric(strategy: Any, cfg: LlamaConfig, data: list[Any], args: argparse.Namespace) -> float:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator=DEVICE.type, devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):
        model = Llama(cfg)
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE.type == "cuda"))

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        fabric.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return measure(step, data, args)


def run_modelpar(cfg: LlamaConfig, data: list[Any], args: argparse.Namespace) -> float:
    from modelpar import ModelParallelStrategy

    return run_fabric(ModelParallelStrategy(plan(args), 1, 1), cfg, data, args)


def run_lightning(cfg: LlamaConfig, data: list[Any], args: argparse.Namespace) -> float:
    from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy

    return run_fabric(LightningStrategy(plan(args), 1, 1), cfg, data, args)


def run_torch(cfg: LlamaConfig, data: list[Any], args: argparse.Namespace) -> float:
    """The same model, plan and policy by hand with torch's public APIs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    names = ("mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention")
    names += ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n)}  # what the plan's "selective" keeps

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    mesh = init_device_mesh(DEVICE.type, (1,))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Llama(cfg)
    for block in model.layers:
        forward = block.forward
        block.forward = partial(  # type: ignore[method-assign]
            checkpoint, forward, use_reentrant=False, context_fn=partial(create_selective_checkpoint_contexts, policy)
        )
        if not args.no_compile:
            block.compile()
    unit = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=unit)
    fully_shard(model, mesh=mesh, mp_policy=root)
    model.to_empty(device=DEVICE)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=DEVICE.type == "cuda")

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return measure(step, data, args)


def main() -> None:
    args = parse()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", device_id=DEVICE)
    else:
        dist.init_process_group("gloo")
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn,
        max_seq_len=args.seq,
    )
    n = matmul_params(cfg)
    per_token = flops_per_token(cfg, n, args.seq)
    peak = peak_flops(args)
    data = batches(cfg, args, args.warmup + args.steps)
    runners = {"modelpar": run_modelpar, "lightning": run_lightning, "torch": run_torch}
    results: dict[str, float] = {}
    for name in args.variants.split(","):
        if DEVICE.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        seconds = runners[name](cfg, data, args)
        results[name] = args.batch * args.seq / seconds
        memory = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if DEVICE.type == "cuda" else ""
        print(f"{name}: {results[name]:.0f} tokens/s{memory}", flush=True)
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    base = results.get("torch")
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (smoke check)"
    print(
        f"\n{where}, torch {torch.__version__}, {n / 1e9:.2f}B matmul parameters,"
        f" batch {args.batch} x {args.seq} tokens, {args.steps} timed steps after {args.warmup}"
        f" (compile {'off' if args.no_compile else 'on'}), peak {peak / 1e12:.1f} TFLOP/s\n"
    )
    print("| variant | tokens/s | MFU (6N+12Lds) | MFU (6N+6Lds, causal) | vs torch by hand |")
    print("|---|---|---|---|---|")
    for name, tps in results.items():
        mfu = [tps * f / peak for f in per_token]
        ratio = f"{tps / base:.3f}x" if base else "-"
        print(f"| {name} | {tps:.0f} | {mfu[0]:.1%} | {mfu[1]:.1%} | {ratio} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
