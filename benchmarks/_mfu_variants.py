"""One run of ``bench_mfu.py``: one variant, one configuration, in this process; the result as one JSON line.

``bench_mfu.py`` starts a fresh process for every run (``--worker``), so that no variant inherits another's
compiled graphs, Dynamo caches or CUDA allocator state; this module is what such a process does. It prints a line
for people (``modelpar: 65900 tokens/s, peak 22.7 GiB, ...``, the line the benchmark always printed) and a line
for the parent (:data:`RESULT_PREFIX` followed by JSON).

The variants train the same model on the same data with the same FSDP2 bf16 policy:

* ``modelpar``: modelpar's ``ModelParallelStrategy`` with ``LLAMA_PLAN`` (its checkpointing and compile);
* ``lightning``: Lightning's ``ModelParallelStrategy`` with the same plan (autocast over fp32 parameters);
* ``torch``: the model sharded by hand with torch's public APIs, as a competent user writes it (no modelpar);
* ``torch-partial``: the hand-written variant as it was until 2026-11-26, which binds ``checkpoint`` with
  ``functools.partial``; under ``torch.compile`` that compiles nothing (see :func:`checkpointed`). Kept to show
  the pitfall on a GPU; not among the default variants;
* ``float8-<recipe>`` (``float8-tensorwise``, ``float8-rowwise``, ``float8-rowwise_with_gw_hp``): the ``modelpar``
  variant with ``ParallelPlan(float8=<recipe>)`` (torchao's float8 training; ``bench_mfu.py --float8``). On the CPU
  smoke check it is emulated (float8's casts and scales, high-precision multiplies): its speed means nothing there;
* ``float8-tensorwise-float8gather`` and ``float8-tensorwise-bf16gather``: tensorwise with FSDP2's float8
  all-gather forced on (``all_gather=True``) and off (``all_gather=False``: weights gathered in bf16 and cast inside
  the compiled blocks). On one GPU there is nothing to gather, and modelpar's default, like torchtitan, turns the
  float8 all-gather on only where FSDP2 shards over more than one rank, so there ``float8-tensorwise`` is
  ``-bf16gather``; ``-float8gather`` beside it shows what the float8 all-gather's casts in FSDP2's eager hooks cost
  (:data:`FLOAT8_SETTINGS`).
* ``torch-float8-<setting>`` (each of :data:`FLOAT8_SETTINGS`): the ``torch`` variant with torchao's float8
  training applied by hand, as torchao's documentation and torchtitan apply it (no modelpar): the same recipe and
  float8 all-gather as ``float8-<setting>``, the scales recomputed after each optimizer step. Measured against
  ``torch`` in bf16, and set beside ``float8-<setting>``, it tells what float8 gains without modelpar, and what
  modelpar's way of applying it costs (``bench_mfu.py --by-hand``).

Every step's loss comes back too (read after the timed steps, so that reading it costs no synchronization inside
them): ``--float8`` compares float8's loss curve with bf16's.

With ``--profile N`` the worker runs N more steps under ``torch.profiler`` after the timed ones and reports where
the device's time went (:func:`profile_steps`): milliseconds per step by kernel kind (:func:`kernel_kind`) and the
busiest kernels. It answers what a tokens/s figure cannot, such as why float8 was slower than bf16 on an H200
(benchmarks/RESULTS.md, 2026-11-27); the profiled steps are not among the timed ones.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import re
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from modelpar.float8 import FLOAT8_CAPABILITY, RECIPES, Float8Training, check_float8_device
from modelpar.models import Llama, LlamaConfig

#: CUDA when there is a GPU; on a machine without one the benchmark runs on the CPU as a smoke check of its own
#: code (tiny sizes, --no-compile, --peak-tflops given): its figures then mean nothing.
DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

T = TypeVar("T")

#: Dense bf16 peak (TFLOP/s, no sparsity) by device name; pass --peak-tflops for others.
PEAKS_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "GH200": 989.4, "B200": 2250.0, "A100": 312.0}

#: Marks the worker's machine-readable line on its standard output.
RESULT_PREFIX = "BENCH_MFU_RESULT "

#: ``--data phrases``: the batches are drawn from this many fixed phrases of ``PHRASE_TOKENS`` tokens each.
PHRASES, PHRASE_TOKENS = 4096, 16

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class RunResult:
    """What one worker measured. ``tokens_per_s`` is over the median timed step; ``None`` fields did not apply."""

    variant: str
    batch: int
    seq: int
    device: str
    torch_version: str
    peak_tflops: float
    tokens_per_s: float | None = None
    step_s: list[float] | None = None
    setup_s: float | None = None
    #: ``torch.compile``'s first call, made before the set-up's timer (:func:`load_compiler`); ``None`` without compile
    compiler_s: float | None = None
    warmup_s: float | None = None
    peak_gib: float | None = None
    compiled_graphs: int | None = None
    oom: str | None = None
    losses: list[float] | None = None
    float8: str | None = None
    emulated: bool = False
    torchao_version: str | None = None
    #: ``--profile``: milliseconds per profiled step by kernel kind, plus ``"step"`` (wall) and ``"busy"`` (all
    #: kinds), and the counts a step of :data:`PROFILE_COUNTS`
    profile_ms: dict[str, float] | None = None
    #: When the worker's ``main`` began (epoch seconds): the parent's spawn time before it is the start-up.
    started_at: float | None = None
    #: Filled by the parent (``bench_mfu.spawn``): the run's whole wall time, from the spawn until the process
    #: ended; its start-up (interpreter and imports, until ``started_at``); and its exit (from the result line
    #: until the process ended: the process group, CUDA and the compile workers shut down).
    wall_s: float | None = None
    startup_s: float | None = None
    exit_s: float | None = None


@dataclass
class Timing:
    setup_s: float
    warmup_s: float
    step_s: list[float]
    losses: list[float]
    profile_ms: dict[str, float] | None = None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's flags, which :func:`config` reads (default: the ~1.1B-parameter Llama of ``bench_mfu.py``): one
    place for every benchmark that sizes that model (``bench_mfu.py``, ``bench_float8_gemm.py``)."""
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=8192)
    p.add_argument("--vocab", type=int, default=32000)


def config(args: argparse.Namespace, seq: int | None = None) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_hidden=args.ffn,
        max_seq_len=seq or args.seq,
    )


def peak_flops(args: argparse.Namespace) -> float:
    if args.peak_tflops:
        return float(args.peak_tflops) * 1e12
    name = device_name()
    tflops = for_device(PEAKS_TFLOPS, name)
    if tflops is None:
        raise SystemExit(f"unknown dense bf16 peak for {name!r}: pass --peak-tflops")
    return tflops * 1e12


def for_device(table: Mapping[str, T], name: str) -> T | None:
    """The entry of ``table`` (keyed by fragments of device names) for the device so named, the longest fragment
    that matches first (``GH200`` before ``H200``), or ``None``."""
    for key, value in sorted(table.items(), key=lambda kv: -len(kv[0])):
        if key in name:
            return value
    return None


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (smoke check)"


#: The float8 settings the benchmark runs: name -> (torchao's recipe, ``Float8Training(all_gather=...)``). Each
#: recipe as modelpar's default sets it (tensorwise on one GPU: weights gathered in bf16, FSDP2 sharding over one
#: rank), tensorwise with FSDP2's float8 all-gather forced on (what the default does where FSDP2 shards over several
#: ranks), and forced off (on one GPU, the default's own choice since 2026-11-28).
FLOAT8_SETTINGS: dict[str, tuple[str, bool | None]] = {
    **{recipe: (recipe, None) for recipe in RECIPES},
    "tensorwise-float8gather": ("tensorwise", True),
    "tensorwise-bf16gather": ("tensorwise", False),
}
#: FSDP2's shard size in every run: one process, one rank. The by-hand variants decide the float8 all-gather for it
#: by modelpar's rule, so that a setting differs between the two only in who applies it.
BENCH_SHARD_SIZE = 1


def plan(args: argparse.Namespace, float8: str | None = None) -> Any:
    """``LLAMA_PLAN`` with ``--ac`` and compile: what the modelpar and Lightning variants apply; with ``float8`` (a
    name of :data:`FLOAT8_SETTINGS`) the float8 variant's, emulated where there is no GPU (the CPU smoke check)."""
    from modelpar.plans import LLAMA_PLAN

    spec = None
    if float8 is not None:
        recipe, all_gather = FLOAT8_SETTINGS[float8]
        spec = Float8Training(recipe, all_gather=all_gather, emulate=DEVICE.type != "cuda")  # type: ignore[arg-type]
    return LLAMA_PLAN.replace(activation_checkpointing=args.ac, compile=not args.no_compile, float8=spec)


#: The prefixes of the float8 variants: modelpar's plan (``float8-<setting>``) and torch's by hand.
FLOAT8_PREFIX, BY_HAND_FLOAT8_PREFIX = "float8-", "torch-float8-"


def float8_variant(setting: str, *, by_hand: bool = False) -> str:
    """The variant training with the float8 setting (a name of :data:`FLOAT8_SETTINGS`): modelpar's, or by hand."""
    return f"{BY_HAND_FLOAT8_PREFIX if by_hand else FLOAT8_PREFIX}{setting}"


def float8_setting(variant: str) -> str | None:
    """The float8 setting ``variant`` trains with, or ``None`` for a bf16 variant."""
    for prefix in (FLOAT8_PREFIX, BY_HAND_FLOAT8_PREFIX):
        if variant.startswith(prefix):
            return variant.removeprefix(prefix)
    return None


def bf16_baseline(variant: str) -> str:
    """The bf16 variant a float8 variant is measured against: the same code without float8 (``modelpar`` for
    ``float8-<setting>``, ``torch`` for ``torch-float8-<setting>``), so that the ratio is float8's alone."""
    return "torch" if variant.startswith(BY_HAND_FLOAT8_PREFIX) else "modelpar"


def batches(cfg: LlamaConfig, args: argparse.Namespace, n: int) -> list[Batch]:
    """``n`` batches, the same in every run: ``--data uniform`` (independent uniform tokens, as the benchmark always
    drew them) or ``--data phrases`` (fixed phrases in random order: a loss that falls, see :func:`phrase_bank`)."""
    g = torch.Generator().manual_seed(0)
    bank = phrase_bank(cfg.vocab_size, g) if args.data == "phrases" else None
    out = []
    for _ in range(n):
        if bank is None:
            tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
        else:
            picks = torch.randint(0, len(bank), (args.batch, args.seq // PHRASE_TOKENS + 2), generator=g)
            tokens = bank[picks].flatten(1)[:, : args.seq + 1]
        tokens = tokens.to(DEVICE)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def phrase_bank(vocab: int, g: torch.Generator) -> torch.Tensor:
    """:data:`PHRASES` phrases of :data:`PHRASE_TOKENS` tokens, drawn with Zipf frequencies (``1 / rank``).

    Why not uniform tokens for a loss comparison: they carry nothing to learn, so every model's loss sits at
    ``ln(vocab)`` whatever its numerics, and two loss curves agree trivially. Here the model learns the token
    frequencies within a few steps (the loss falls by nats), then the phrases (15 of every 16 next tokens are
    determined), so float8's curve is compared with bf16's while both move, as ``docs/float8.md`` states its
    tolerance. The values do not change the work: tokens/s is the same on either data.
    """
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64)
    return torch.multinomial(weights, PHRASES * PHRASE_TOKENS, replacement=True, generator=g).view(PHRASES, -1)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def load_compiler() -> float:
    """Seconds of ``torch.compile``'s first call in this process, made here, on a function that is never run.

    Why before the set-up's timer: the first ``torch.compile`` of a process imports torch's compiler stack (Dynamo
    and inductor, about 550 modules: 0.9-1.0 s of the 2.2-2.5 s that a one-rank set-up of a 0.2B model took on the
    2-core CPU on 2026-11-28), and every variant's set-up makes that call (the plan's ``compile``;
    ``block.compile()`` by hand). Inside the timer those imports are the same work in every variant, as slow as the
    machine's file cache makes them at that moment: on 2026-11-28 modelpar's set-up on an H200 read 4.30 s in one
    run and 2.58-2.76 s in five others, and the slow runs' start-up (the imports before ``main``) was slow too. Made
    here, the set-up compares what the strategies do; the import is reported beside it (``compiler_s``), so the
    set-up as measured before is their sum.
    """
    start = time.perf_counter()
    torch.compile(_never_run)
    return time.perf_counter() - start


def _never_run(x: torch.Tensor) -> torch.Tensor:
    return x


@contextmanager
def setup_timer(args: argparse.Namespace) -> Iterator[list[float]]:
    """Time the set-up inside this block, synchronized on both ends; the seconds are appended to the list it gives.

    With ``--profile-setup N`` the block runs under ``cProfile`` and its N functions of longest cumulative time are
    printed after it: where a set-up's seconds go on the machine at hand (Python calls, imports, and the
    synchronization that waits for the device's work), which a ratio alone cannot say. The profiler slows the
    set-up, so its seconds are then no measurement (the report says so).
    """
    profiler = cProfile.Profile() if args.profile_setup else None
    seconds: list[float] = []
    sync()
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    yield seconds
    sync()
    if profiler is not None:
        profiler.disable()
    seconds.append(time.perf_counter() - start)
    if profiler is not None:
        print_setup_profile(profiler, args.profile_setup)


def print_setup_profile(profiler: cProfile.Profile, top: int) -> None:
    """The ``top`` functions of the profiled set-up by cumulative time, each with its own time and calls; paths
    shortened to the package (``torch/...``, ``modelpar/...``) so that runs on different machines compare."""
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:top]  # type: ignore[attr-defined]
    print(f"set-up profile (cProfile; the {len(rows)} longest by cumulative time: cumulative s, own s, calls):")
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{re.sub(r'^.*?/(site-packages|src)/', '', path)}:{line}({name})" if path != "~" else name
        print(f"  {cumulative:7.3f} {own:7.3f} {calls:7d}  {where}", flush=True)


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def measure(step: Step, data: list[Batch], args: argparse.Namespace) -> Timing:
    """Seconds of the ``args.warmup`` untimed steps (compilation happens there) and of each timed step, and every
    step's loss.

    ``step`` returns its loss detached, still on the device: the values are read once, after the last step, so
    the timed steps synchronize exactly as they did before losses were recorded (once each, at its end).
    """
    losses = []
    start = time.perf_counter()
    for x, y in data[: args.warmup]:
        losses.append(step(x, y))
    sync()
    warmup = time.perf_counter() - start
    times = []
    for x, y in data[args.warmup :]:
        start = time.perf_counter()
        losses.append(step(x, y))
        sync()
        times.append(time.perf_counter() - start)
    values = torch.stack(losses).float().cpu().tolist() if losses else []
    profiled = profile_steps(step, data, args.profile) if args.profile else None
    return Timing(setup_s=0.0, warmup_s=warmup, step_s=times, losses=values, profile_ms=profiled)


#: :func:`kernel_kind`'s kinds, in the order the report prints them, each with the words its kernels' names hold.
#: Names are the kernels' own (cuBLAS, CUTLASS, flash attention, Triton, NCCL); on the CPU smoke check, aten
#: operators'. The words are a reading of those names, not an API: ``--profile`` also prints the busiest kernels by
#: name, so a kernel in the wrong kind shows there. :func:`kernel_kind` applies them in its own order (inductor's
#: kernels first, a multiply's precision from :data:`FLOAT8_WORDS`), since a name can hold another kind's words.
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("float8 matmul", ()),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn_generated_fort_native_sdpa")),
    (
        "matmul",
        ("gemm", "nvjet", "cutlass", "xmma", "cublas", "scaled_mm", "aten::mm", "aten::addmm", "aten::bmm", "matmul"),
    ),
    ("communication", ("nccl", "gloo", "c10d")),
    ("Triton (compiled)", ("triton",)),
    ("copy and fill", ("memcpy", "memset", "copy", "fill")),
)
OTHER_KIND = "other"
#: Besides milliseconds, :func:`profile_steps` returns these counts a step: the aten operators the host called, and
#: the kernels that ran (on the CPU smoke check, the operators with time of their own).
PROFILE_COUNTS = ("host ops", "kernels")
#: What makes a multiply (a name with the "matmul" kind's words) a float8 one: CUTLASS's and cuBLAS's element types
#: (``e4m3``, ``f8f8``), torch's ``_scaled_mm``, and cuBLAS's ``nvjet`` kernels whose operand types are float8
#: (``nvjet_sm90_qqtst_*``, ``nvjet_sm90_qrtst_*`` on the H200, 2026-11-28, where bf16's read ``nvjet_sm90_tst_*``).
FLOAT8_WORDS = ("e4m3", "e5m2", "fp8", "f8f8", "float8", "scaled_mm")
_NVJET_FLOAT8 = re.compile(r"nvjet_(?:sm\d+_)?[qr]{2}")
#: Inductor's pointwise and reduction kernels (``triton_poi_``, ``triton_red_``, ``triton_per_``): compiled code,
#: whatever operators their names list. A cast's kernel is named after the multiply it feeds
#: (``triton_red_fused__scaled_mm__to_copy_abs_amax_...``), which until 2026-11-28 put float8's casts among the float8
#: multiplies. Triton's templates (``triton_tem_``) can be multiplies, and are read by their words.
_INDUCTOR_KERNEL = re.compile(r"^triton_(?:poi|red|per)_")


def kernel_kind(name: str) -> str:
    """The kind of a kernel (or, on the CPU, an operator) by its name: one of :data:`KERNEL_KINDS`, else ``"other"``.

    Inductor's pointwise and reduction kernels are Triton whatever they fuse; a multiply is a float8 one if its name
    says so (:data:`FLOAT8_WORDS`, cuBLAS's float8 ``nvjet`` kernels); an eager cast to float8 is no multiply.
    """
    lowered = name.lower()
    if _INDUCTOR_KERNEL.match(lowered):
        return "Triton (compiled)"
    for kind, words in KERNEL_KINDS:
        if any(word in lowered for word in words):
            if kind == "matmul" and (any(w in lowered for w in FLOAT8_WORDS) or _NVJET_FLOAT8.search(lowered)):
                return "float8 matmul"
            return kind
    return OTHER_KIND


def profile_steps(step: Step, data: list[Batch], n: int, top: int = 12) -> dict[str, float]:
    """Run ``n`` steps under ``torch.profiler``; print the busiest kernels, return ms per step by kind.

    The device's own time per kernel (``self_device_time_total``) on a GPU; on the CPU smoke check, each
    operator's self CPU time, so the code runs end to end there. ``"step"`` is the wall time per step and
    ``"busy"`` the sum of the kinds: on a GPU, a busy time well under the step's means the device waited on the
    host (launch overhead, eager code). Ranges that are no kernels (a ``record_function``'s on the GPU's timeline,
    such as the optimizer step's) are left out: until 2026-11-28 they were counted beside the kernels they span, and
    ``busy`` came out over ``step``. Two counts a step come with them (:data:`PROFILE_COUNTS`): the aten
    operators the host called and the kernels (on the CPU, operators with time of their own) that ran. The host's
    share of a step is what a faster device waits on: on CPU, modelpar's float8 all-gather on one rank added
    about 2,400 operators a step to the 1.07B model's 10,900 (``benchmarks/RESULTS.md``, 2026-11-28).
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    on_gpu = DEVICE.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    chosen = [data[i % len(data)] for i in range(n)]
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for x, y in chosen:
            step(x, y)
        sync()
        wall = time.perf_counter() - start
    events = list(prof.key_averages())
    host_ops = sum(e.count for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::"))
    if on_gpu:  # the kernels; without kernel events of their own, the operators' device time (nested ops excluded)
        events = [e for e in events if e.device_type == DeviceType.CUDA] or events
        # a record_function's range on the GPU timeline (the optimizer step's, FSDP's) spans kernels counted already
        events = [e for e in events if not getattr(e, "is_user_annotation", False)]
    per_kernel: dict[str, tuple[float, int]] = {}
    for event in events:
        micros = event.self_device_time_total if on_gpu else event.self_cpu_time_total
        if micros > 0:
            total, count = per_kernel.get(event.key, (0.0, 0))
            per_kernel[event.key] = (total + micros, count + event.count)
    by_kind: dict[str, float] = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {OTHER_KIND: 0.0}
    for name, (micros, _) in per_kernel.items():
        by_kind[kernel_kind(name)] += micros / 1e3 / n
    busiest = sorted(per_kernel.items(), key=lambda item: -item[1][0])[:top]
    what = "kernels (device time)" if on_gpu else "operators (self CPU time; the smoke check)"
    print(f"profile: {n} step(s), {wall / n * 1e3:.1f} ms per step; the busiest {what}, ms per step:", flush=True)
    for name, (micros, count) in busiest:
        print(f"  {micros / 1e3 / n:8.2f}  x{count // n:<4d} {kernel_kind(name):18s} {name[:110]}", flush=True)
    kernels = sum(count for _, count in per_kernel.values())
    counts = dict(zip(PROFILE_COUNTS, (host_ops / n, kernels / n), strict=True))
    return {"step": wall / n * 1e3, "busy": sum(by_kind.values()), **by_kind, **counts}


def run_fabric(strategy: Any, cfg: LlamaConfig, data: list[Batch], args: argparse.Namespace) -> Timing:
    from lightning_fabric import Fabric

    fabric = Fabric(accelerator=DEVICE.type, devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    torch.manual_seed(0)
    with setup_timer(args) as setup:  # the meta-device model until it is sharded and materialized
        with fabric.init_module(empty_init=True):
            model = Llama(cfg)
        module = fabric.setup_module(model)
    if args.setup_only:
        return Timing(setup_s=setup[0], warmup_s=0.0, step_s=[], losses=[])
    optimizer: Any = fabric.setup_optimizers(torch.optim.AdamW(module.parameters(), lr=1e-4, fused=_fused()))

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(module(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    timing = measure(step, data, args)
    timing.setup_s = setup[0]
    return timing


def run_modelpar(cfg: LlamaConfig, data: list[Batch], args: argparse.Namespace, *, float8: str | None = None) -> Timing:
    """modelpar's strategy with the plan; with ``float8`` (a recipe), the same plan training in float8."""
    from modelpar import ModelParallelStrategy

    return run_fabric(ModelParallelStrategy(plan(args, float8), 1, 1), cfg, data, args)


def run_lightning(cfg: LlamaConfig, data: list[Batch], args: argparse.Namespace) -> Timing:
    from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy

    return run_fabric(LightningStrategy(plan(args), 1, 1), cfg, data, args)


def checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any] | None) -> Callable[..., Any]:
    """``forward`` under non-reentrant activation checkpointing, through a function of this file.

    Why not ``functools.partial(checkpoint, forward, ...)`` (the ``torch-partial`` variant): ``block.compile()``
    compiles ``nn.Module._call_impl``, a frame of torch's that Dynamo skips, and Dynamo then starts at the next
    frame it may trace. Behind a partial that frame is ``torch.utils.checkpoint.checkpoint`` itself, which is
    torch's too and decorated ``@torch._disable_dynamo``: everything below it runs with Dynamo off. The block is
    then never compiled, silently, and selective checkpointing runs eagerly (its policy intercepting every op).
    With a function of our own as ``forward``, Dynamo starts here, traces ``checkpoint`` as a higher-order op
    (the policy applied when the graph is partitioned) and compiles the whole block, as it does modelpar's.
    """

    def run(*args: Any, **kwargs: Any) -> Any:
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def run_torch(
    cfg: LlamaConfig,
    data: list[Batch],
    args: argparse.Namespace,
    *,
    as_partial: bool = False,
    float8: str | None = None,
) -> Timing:
    """The same model, checkpointing, compile and bf16 policy by hand with torch's public APIs (no modelpar).

    torchtitan's order: float8, then checkpointing, then ``compile`` per block, then ``fully_shard`` bottom-up, so
    FSDP's hooks stay outside the compiled and recomputed region. ``as_partial``: bind ``checkpoint`` with
    ``functools.partial`` instead of :func:`checkpointed` (the pre-2026-11-26 baseline, which compiles nothing under
    checkpointing). ``float8``: a name of :data:`FLOAT8_SETTINGS`, applied with torchao's API
    (:func:`float8_by_hand`).
    """
    from torch.distributed.device_mesh import init_device_mesh

    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "_scaled_mm", "_scaled_dot_product_flash_attention"]
    names += ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"]
    names += ["_scaled_dot_product_flash_attention_for_cpu"]
    saved = {getattr(aten, n).default for n in names if hasattr(aten, n)}  # what the plan's "selective" keeps

    def policy(ctx: Any, op: Any, *a: Any, **k: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    context_fn = partial(create_selective_checkpoint_contexts, policy) if args.ac == "selective" else None
    mesh = init_device_mesh(DEVICE.type, (1,))
    torch.manual_seed(0)
    with setup_timer(args) as setup:  # the meta-device model until it is sharded and materialized
        model, precompute = build_by_hand(cfg, args, mesh, context_fn, as_partial=as_partial, float8=float8)
    if args.setup_only:
        return Timing(setup_s=setup[0], warmup_s=0.0, step_s=[], losses=[])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=_fused())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        if precompute is not None:  # torchao's rule under the float8 all-gather: the new weights' scales, at once
            precompute(model)
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    timing = measure(step, data, args)
    timing.setup_s = setup[0]
    return timing


def build_by_hand(
    cfg: LlamaConfig,
    args: argparse.Namespace,
    mesh: Any,
    context_fn: Callable[[], Any] | None,
    *,
    as_partial: bool,
    float8: str | None,
) -> tuple[torch.nn.Module, Callable[[torch.nn.Module], None] | None]:
    """The ``torch`` variant's set-up: the model on the meta device, float8 (``float8``), checkpointing, compile per
    block, ``fully_shard`` bottom-up, then allocated and initialized by its own ``reset_parameters``; with the float8
    scales' precompute, or ``None``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with torch.device("meta"):
        model = Llama(cfg)
    precompute = float8_by_hand(model, float8) if float8 is not None else None
    for block in model.layers:
        if args.ac != "none" and as_partial and context_fn is not None:
            block.forward = partial(checkpoint, block.forward, use_reentrant=False, context_fn=context_fn)
        elif args.ac != "none" and as_partial:
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
        elif args.ac != "none":
            block.forward = checkpointed(block.forward, context_fn)
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
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    return model, precompute


def float8_by_hand(model: torch.nn.Module, setting: str) -> Callable[[torch.nn.Module], None] | None:
    """Convert ``model`` (on the meta device, before checkpointing, compile and FSDP) to torchao's float8 training
    as torchao's documentation and torchtitan do it, with torchao's API alone: the recipe's config, the float8
    all-gather as ``float8-<setting>`` sets it (for the two variants to differ only in who applies it), every
    linear layer but the output layer whose dimensions are multiples of 16. Returns
    ``precompute_float8_dynamic_scale_for_fsdp`` when weights are all-gathered in float8 (the caller runs it after
    each optimizer step, as torchao asks its users to), else ``None``. Emulated without a GPU (the smoke check).
    """
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training, precompute_float8_dynamic_scale_for_fsdp

    recipe, all_gather = FLOAT8_SETTINGS[setting]
    # Whether to all-gather in float8: modelpar's rule for the setting, so that only who applies it differs.
    gathers = Float8Training(recipe, all_gather=all_gather).gathers_in_float8_over(BENCH_SHARD_SIZE)  # type: ignore[arg-type]
    config = replace(
        Float8LinearConfig.from_recipe_name(recipe),
        enable_fsdp_float8_all_gather=gathers,
        emulate=DEVICE.type != "cuda",
    )

    def wanted(module: torch.nn.Module, fqn: str) -> bool:
        return fqn != "output" and all(size % 16 == 0 for size in module.weight.shape)

    convert_to_float8_training(model, module_filter_fn=wanted, config=config)
    return precompute_float8_dynamic_scale_for_fsdp if gathers else None


def _fused() -> bool:
    return DEVICE.type == "cuda"


RUNNERS: dict[str, Callable[[LlamaConfig, list[Batch], argparse.Namespace], Timing]] = {
    "modelpar": run_modelpar,
    "lightning": run_lightning,
    "torch": run_torch,
    "torch-partial": partial(run_torch, as_partial=True),
    **{float8_variant(setting): partial(run_modelpar, float8=setting) for setting in FLOAT8_SETTINGS},
    **{float8_variant(setting, by_hand=True): partial(run_torch, float8=setting) for setting in FLOAT8_SETTINGS},
}


def float8_refusal() -> str | None:
    """Why this machine cannot run the float8 variants, or ``None``: torchao missing, too old or broken (with the
    install command), or a GPU without float8 kernels (as modelpar's ``check_float8_device`` decides; the reason
    names the GPU and its compute capability).

    Run by ``bench_mfu.py --check-float8`` in a process of its own, so that the parent, which starts every run,
    never initializes CUDA itself. Without a GPU (the smoke check) the variants are emulated: no refusal.
    """
    from modelpar.float8._torchao import check_torchao_version, installed_torchao

    version = installed_torchao()
    try:
        check_torchao_version(version)  # modelpar's own floor and message, naming the extra to install
        import torchao.float8  # noqa: F401  (what the float8 variants convert with: it must import with this torch)
    except Exception as error:  # any import-time failure of the optional package is a reason to skip, said so
        return f"torchao {version or '(none)'}: {type(error).__name__}: {error}"
    if DEVICE.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(DEVICE)
    try:
        check_float8_device("cuda", capability, emulate=False)  # modelpar decides, as a plan on this GPU would
    except RuntimeError:
        need = ".".join(map(str, FLOAT8_CAPABILITY))
        return (
            f"{device_name()} has compute capability {capability[0]}.{capability[1]}: float8 matrix multiplies need"
            f" {need} or newer (L4, L40, H100, H200, B200)"
        )
    return None


def compiled_graphs() -> int | None:
    """Graphs Dynamo compiled in this process; ``None`` if torch's (private) counter is not where it was.

    With compile on, 0 means the model ran eagerly: the ``torch-partial`` variant's defect, made visible.
    """
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["stats"].get("unique_graphs", 0))


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def run_worker(args: argparse.Namespace) -> None:
    """Run ``args.variants`` (one name) at ``args.batch`` x ``args.seq``; print its line and its JSON result.

    Out of memory is a result (``oom`` holds the message), not a crash, so a sweep can note it and go on. The
    process group is left to the process's end (``bench_mfu.end_worker``), which follows the result at once.
    """
    started_at = time.time()
    peak = peak_flops(args) / 1e12  # before anything slow: an unknown GPU fails at once
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", device_id=DEVICE)
    else:
        dist.init_process_group("gloo")
    name = args.variants
    result = RunResult(name, args.batch, args.seq, device_name(), torch.__version__, peak, started_at=started_at)
    result.float8 = float8_setting(name)
    if result.float8 is not None:
        from importlib import metadata

        result.emulated = DEVICE.type != "cuda"
        result.torchao_version = metadata.version("torchao")
    cfg = config(args)
    data = batches(cfg, args, args.warmup + args.steps)
    if not args.no_compile:
        result.compiler_s = load_compiler()
    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        timing = RUNNERS[name](cfg, data, args)
    except (torch.OutOfMemoryError, RuntimeError) as err:
        if not _is_oom(err):
            raise
        result.oom = str(err).splitlines()[0][:300]
        print(f"{name}: out of memory at batch {args.batch} x {args.seq} ({result.oom})", flush=True)
    else:
        result.setup_s, result.warmup_s = timing.setup_s, timing.warmup_s
        compiler = ""
        if result.compiler_s is not None:
            compiler = f" (torch.compile's imports before it: {result.compiler_s:.2f} s)"
        memory = ""
        if DEVICE.type == "cuda":
            result.peak_gib = torch.cuda.max_memory_allocated() / 2**30
            memory = f", peak {result.peak_gib:.1f} GiB"
        if args.setup_only:
            print(f"{name}: set-up {timing.setup_s:.2f} s{compiler}{memory} (--setup-only: no steps)", flush=True)
        else:
            result.step_s, result.losses = timing.step_s, timing.losses
            result.tokens_per_s = args.batch * args.seq / statistics.median(timing.step_s)
            result.compiled_graphs = compiled_graphs()
            result.profile_ms = timing.profile_ms
            print(
                f"{name}: {result.tokens_per_s:.0f} tokens/s{memory}, set-up {timing.setup_s:.2f} s{compiler},"
                f" first {args.warmup} steps {timing.warmup_s:.1f} s, compiled graphs {result.compiled_graphs}",
                flush=True,
            )
    print(RESULT_PREFIX + json.dumps(asdict(result)), flush=True)
