"""Model FLOP utilization on one GPU: modelpar vs Lightning's strategy vs torch's ``fully_shard`` by hand.

    python benchmarks/bench_mfu.py [--ac none|selective|full --repeats 3 --batch 4 --seq 2048 --steps 20]
    python benchmarks/bench_mfu.py --sweep [--ac none]
    python benchmarks/bench_mfu.py --float8 tensorwise[,rowwise] [--repeats 3]

A ~1.1B-parameter Llama-style model (``modelpar.models.Llama``: dim 2048, 16 layers, 16 heads, 8 KV heads, SwiGLU
8192, vocabulary 32000) trains in bf16 on one GPU (NCCL, 1x1 mesh) with the best single-GPU plan: activation
checkpointing (``--ac``, default ``selective`` as the plan's), ``torch.compile`` per block, FSDP2's bf16 policy
(parameters all-gathered and computed in bf16, gradients reduced in fp32, fp32 master weights and AdamW). The
variants (``_mfu_variants.py`` says what each one does) train the same model on the same data:

* ``modelpar``: ``ModelParallelStrategy(LLAMA_PLAN.replace(activation_checkpointing=..., compile=True))`` with
  ``precision="bf16-mixed"`` (the strategy derives the bf16 policy);
* ``lightning``: Lightning's ``ModelParallelStrategy`` with the same plan (it runs ``"bf16-mixed"`` as autocast
  over fp32 FSDP2 parameters, its documented behaviour);
* ``torch``: the same model sharded by hand: ``torch.utils.checkpoint``, ``compile`` and ``fully_shard`` per block
  and on the root, with the bf16 ``MixedPrecisionPolicy``;
* ``torch-partial`` (only when named): the hand-written variant as it was until 2026-11-26. It bound
  ``checkpoint`` with ``functools.partial`` as the block's ``forward``, which ``torch.compile`` never traces
  (``checkpoint`` is decorated ``@torch._disable_dynamo``): under checkpointing its blocks ran uncompiled, at half
  modelpar's speed on an H200. That was the "1.906x vs torch by hand"; see ``_mfu_variants.checkpointed``.

Every run is its own process (``--worker``), so that no variant inherits another's compiled graphs, Dynamo caches
or CUDA allocator; the variants take turns in an order that rotates every round (``--repeats``). Inductor's cache on
disk is shared on purpose: it shortens compilation but gives the same kernels, so the timed steps do not change.

Reported per variant: tokens/s (each run: its median timed step after warm-up steps that include compilation; the
table: the median over the runs and their min-max), MFU against the GPU's dense bf16 peak under both FLOP
conventions,

* ``6N + 12·L·d·s`` per token, no causal discount (torchtitan, MosaicML): N counts the parameters that take part
  in matrix multiplies (all but the input embedding), L layers, d the model width, s the sequence length;
* ``6N + 6·L·d·s``: the attention term halved for the causal mask (Megatron-LM);

the ratios modelpar / torch by hand and modelpar / Lightning, the peak memory (``torch.cuda.max_memory_allocated``)
beside modelpar's ``estimate_memory`` for the same model and plan, the set-up time (the meta-device model until it
is sharded and materialized, timed after ``torch.compile``'s first call has imported torch's compiler stack, whose
seconds are reported beside it: ``_mfu_variants.load_compiler``) and the graphs each run compiled (none under
compile: it ran eagerly). ``--sweep`` runs modelpar alone over batch sizes and sequence lengths (2k, 8k) and
names the fastest configuration that fits; out-of-memory configurations are noted and skipped. Record results in
``benchmarks/RESULTS.md`` with the date, GPU and versions.

``--float8 RECIPE[,RECIPE]`` (issue 29) puts float8 training against bf16 on the same model, plan and data:
``modelpar`` in bf16 and ``float8-<recipe>`` (the same plan with ``float8=<recipe>``, torchao's float8 training),
each run in its own process in rotating order as above. It trains on ``--data phrases`` (fixed phrases: a loss that
falls, so the curves are compared while they move; uniform tokens leave every loss at ``ln(vocab)``) and reports,
besides the table, ``[summary]`` lines: each recipe's tokens/s against bf16's with issue 29's goal (at least
1.2x), the peak memory of both, and how far float8's loss curve is from bf16's: the largest relative difference
of the per-step losses over the timed steps (each variant's curve: the per-step median of its runs), against
``--loss-rtol`` (default: the 2% that ``docs/float8.md`` states). A machine that cannot run float8 (no torchao, or
a GPU of compute capability below 8.9) gets the reason and no float8 run; without a GPU the float8 variants are
emulated (the smoke check: their figures mean nothing).

Each run's wall time is split into its phases (``(modelpar: run 37.0 s: start-up ..., compile imports ...,
set-up ..., warm-up ..., timed steps ..., exit ..., the rest ...)`` after the run, and a ``[time]`` line of their
medians at the end), so a benchmark that takes too long (``gpu-check.sh`` runs it and must stay under 5 minutes)
says where.

``--float8 tensorwise-float8gather`` runs tensorwise with FSDP2's float8 all-gather forced on, which modelpar's
default turns on only where FSDP2 shards over several ranks: beside ``tensorwise`` on one GPU (weights gathered in
bf16 and cast inside the compiled blocks), what the float8 all-gather's eager casts cost. ``tensorwise-bf16gather``
forces it off (on one GPU, the default's own choice since 2026-11-28).

``--setup-only`` times the set-up alone (no steps: several rounds of it in the minutes one training run takes)
and reports each variant's set-up, median and min-max, beside torch.compile's imports and the start-up;
``--profile-setup N`` runs each set-up under cProfile and prints its N longest functions (docs/gpu.md, "Set-up on a
GPU").

``--by-hand`` (with ``--float8``) also runs each setting by hand, ``torch-float8-<setting>``: the ``torch`` variant
converted with torchao's API as its documentation and torchtitan do it, no modelpar. Each float8 variant is measured
against its own bf16 (``float8-*`` against ``modelpar``, ``torch-float8-*`` against ``torch``), and the summary sets
the two side by side: whether float8 itself falls short of the goal here, or modelpar's way of applying it.

Each float8 recipe's ``[summary]`` lines include what it can gain on this model at the roofline
(``_float8_roofline.py``: the converted layers' multiplies and casts from their shapes and the GPU's data sheet,
the rest of the step as bf16 measured it), so that a ratio below the goal says whether the model could reach it.
``--roofline GPU[:TOKENS_PER_S]`` prints the same for any model without a GPU and runs nothing:

    python benchmarks/bench_mfu.py --roofline H200:65303 [--float8 tensorwise,rowwise --dim 4096 ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import NoReturn

import torch
from _float8_roofline import (
    BANDWIDTH_EFFICIENCY,
    GEMM_EFFICIENCY,
    SPECS,
    GpuSpecs,
    Roofline,
    layer_shapes,
    roofline,
    specs_for,
)
from _mfu_variants import (
    FLOAT8_SETTINGS,
    PROFILE_COUNTS,
    RESULT_PREFIX,
    RUNNERS,
    RunResult,
    add_model_arguments,
    bf16_baseline,
    config,
    float8_refusal,
    float8_setting,
    float8_variant,
    plan,
    run_worker,
)

from modelpar.models import Llama, LlamaConfig

#: ``--repeats`` left out: this many rounds, a later one only if the rounds so far predict it ends within
#: ``DEFAULT_BUDGET_S`` (``scripts/gpu-check.sh`` runs the benchmark with no arguments and must stay short).
DEFAULT_ROUNDS, DEFAULT_BUDGET_S = 2, 90.0

#: Issue 29's goal for float8 training on an H100-class GPU: at least this many times bf16's tokens/s.
FLOAT8_GOAL = 1.2
#: ``--loss-rtol`` left out: ``docs/float8.md``'s stated tolerance, each step's loss within 2% of bf16's.
FLOAT8_LOSS_RTOL = 0.02
#: ``--variants`` left out: these; with float8 variants, the one modelpar's are measured against (modelpar in bf16),
#: which then always runs, named or not (as ``torch`` does for the ``--by-hand`` ones: ``bf16_baseline``).
DEFAULT_VARIANTS, BF16_BASELINE = "modelpar,lightning,torch", "modelpar"

#: What ``estimate_memory`` counts as kept activations under each ``activation_checkpointing``.
AC_STORES = {
    "none": "every activation kept",
    "selective": "each layer's input and its matmul and attention outputs kept, the rest recomputed",
    "full": "each layer's input kept, the layer recomputed",
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation happens here)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--variants",
        default=None,
        help=f"of: {', '.join(RUNNERS)} (default: {DEFAULT_VARIANTS}; with --float8: {BF16_BASELINE} and its recipes)",
    )
    p.add_argument(
        "--float8",
        default=None,
        metavar="RECIPES",
        help=f"float8 against bf16: a comma list of {', '.join(FLOAT8_SETTINGS)} (adds float8-<name> variants;"
        " tensorwise-float8gather / -bf16gather: tensorwise with FSDP2's float8 all-gather forced on / off)",
    )
    p.add_argument(
        "--by-hand",
        action="store_true",
        help="with --float8: each setting by hand too (torch-float8-<name>: torchao's API without modelpar, against"
        " torch in bf16), to tell float8's own shortfall from modelpar's",
    )
    p.add_argument(
        "--data",
        choices=("uniform", "phrases"),
        default=None,
        help="the batches: uniform tokens (default) or fixed phrases (default with float8 variants: a loss that falls)",
    )
    p.add_argument(
        "--loss-rtol",
        type=float,
        default=FLOAT8_LOSS_RTOL,
        help=f"float8's per-step loss tolerance, relative to bf16's (default {FLOAT8_LOSS_RTOL:g}, docs/float8.md's)",
    )
    p.add_argument(
        "--roofline",
        default=None,
        metavar="GPU[:TOKENS_PER_S]",
        help=f"run nothing: print what float8 can gain on this model on a GPU of {', '.join(SPECS)} (its recipes of"
        " --float8, default tensorwise,rowwise); with bf16's measured tokens/s, the step's gain too",
    )
    p.add_argument("--no-compile", action="store_true", help="leave out torch.compile (all variants)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not known here")
    p.add_argument("--ac", choices=("none", "selective", "full"), default="selective", help="activation checkpointing")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help=f"rounds of runs, one process each (default: {DEFAULT_ROUNDS} within the time budget; --sweep: 1)",
    )
    p.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help=f"seconds: start no round predicted to end later (default {DEFAULT_BUDGET_S:.0f} without --repeats)",
    )
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="after the timed steps, this many more under torch.profiler: device time per step by kernel kind",
    )
    p.add_argument(
        "--setup-only",
        action="store_true",
        help="time the set-up alone (no steps): many runs for the set-up ratio in the time one training run takes",
    )
    p.add_argument(
        "--profile-setup",
        type=int,
        default=0,
        metavar="N",
        help="run each set-up under cProfile and print its N longest functions (its seconds then mean nothing)",
    )
    p.add_argument("--sweep", action="store_true", help="modelpar over --sweep-seqs x --sweep-tokens instead")
    p.add_argument("--sweep-seqs", default="2048,8192", help="sequence lengths of the sweep")
    p.add_argument("--sweep-tokens", default="8192,16384,32768", help="tokens per step (batch = tokens / seq)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one run in this process
    p.add_argument("--check-float8", action="store_true", help=argparse.SUPPRESS)  # can this machine run float8?
    args = p.parse_args(argv)
    recipes = args.float8.split(",") if args.float8 is not None else []
    wrong = [r for r in recipes if r not in FLOAT8_SETTINGS]
    if wrong or (args.float8 is not None and not recipes):
        p.error(f"--float8 {args.float8!r}: unknown {wrong}; choose from {', '.join(FLOAT8_SETTINGS)} (a comma list)")
    if args.float8 is not None and args.sweep:
        p.error("--sweep runs modelpar alone over sizes; --float8 compares variants at one size: use one of them")
    if args.setup_only and (args.float8 is not None or args.sweep or args.profile):
        p.error("--setup-only times the set-up alone: --float8, --sweep and --profile need the training steps")
    if args.profile_setup < 0:
        p.error(f"--profile-setup {args.profile_setup}: give how many functions to print, e.g. 25")
    if args.by_hand and args.float8 is None:
        p.error("--by-hand runs --float8's settings by hand: give them, e.g. --float8 tensorwise --by-hand")
    if args.roofline is not None:
        tps = args.roofline.partition(":")[2]
        try:
            ok = not tps or float(tps) > 0
        except ValueError:
            ok = False
        if not ok or not args.roofline.partition(":")[0]:
            p.error(f"--roofline {args.roofline!r}: give a GPU's name and, after a colon, bf16's tokens/s: H200:65303")
    #: The bf16 variants that run only because float8 variants are measured against them (not asked for by name).
    args.baselines_added = []
    if not args.worker:
        variants = (args.variants or (BF16_BASELINE if recipes else DEFAULT_VARIANTS)).split(",")
        variants += [float8_variant(r) for r in recipes]
        variants += [float8_variant(r, by_hand=True) for r in recipes] if args.by_hand else []
        variants = list(dict.fromkeys(variants))
        named = args.variants.split(",") if args.variants else []
        needed = dict.fromkeys(bf16_baseline(v) for v in variants if float8_setting(v) is not None)
        args.baselines_added = [b for b in needed if b not in named]  # float8 is measured against them: first
        variants = [*args.baselines_added, *(v for v in variants if v not in args.baselines_added)]
        args.variants = ",".join(variants)
    unknown = [v for v in (args.variants or "").split(",") if v not in RUNNERS]
    if unknown or not args.variants:
        p.error(f"--variants {args.variants!r}: unknown {unknown}; choose from {', '.join(RUNNERS)}")
    if args.worker and "," in args.variants:
        p.error(f"--worker runs one variant, got --variants {args.variants!r}")
    if args.data is None:  # the parent decides and passes it on: every worker of a run gets the same data
        args.data = "phrases" if any(float8_setting(v) for v in args.variants.split(",")) else "uniform"
    return args


def flops_per_token(cfg: LlamaConfig, n_matmul_params: int, seq: int) -> tuple[float, float]:
    """(no causal discount, causal discount): 6N + 12·L·d·s and 6N + 6·L·d·s."""
    attention = 12 * cfg.n_layers * cfg.dim * seq
    return 6 * n_matmul_params + attention, 6 * n_matmul_params + attention / 2


def matmul_params(cfg: LlamaConfig) -> int:
    """Parameters of the model minus the input embedding (a lookup, not a matrix multiply) and the norms."""
    with torch.device("meta"):
        model = Llama(cfg)
    return sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and not n.startswith("tok_embeddings"))


def estimate(args: argparse.Namespace, batch: int, seq: int, float8: str | None = None) -> tuple[float, str]:
    """modelpar's predicted peak (GiB) for modelpar's layout of this run, and the activation setting it assumes.

    Computed on the meta device (no memory, no process group): one rank, the ``"bf16-mixed"`` policy the strategy
    derives (the hand-written variant uses the same one), AdamW, ``batch`` x ``seq`` tokens under ``--ac``; with
    ``float8`` (a name of ``FLOAT8_SETTINGS``) for the float8 variant's plan, so the estimate counts what it knows
    of float8.
    """
    from modelpar import estimate_memory

    with torch.device("meta"):
        model = Llama(config(args, seq))
    est = estimate_memory(
        model,
        plan=plan(args, float8),
        data_parallel_size=1,
        precision="bf16-mixed",
        optimizer="adamw",
        seq_len=seq,
        micro_batch_size=batch,
    )
    return est.peak / 2**30, est.setting


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(args: argparse.Namespace, variant: str, batch: int, seq: int) -> RunResult | None:
    """Run ``variant`` at ``batch`` x ``seq`` in a fresh process; its output passes through, its result comes back.

    ``None`` when the process failed (its traceback is on the terminal). The worker gets this run's own arguments,
    so every flag reaches it, followed by its own (``--variants``, ``--batch``, ``--seq``), which win.
    """
    cmd = [sys.executable, str(Path(__file__).resolve()), *sys.argv[1:]]
    cmd += ["--worker", "--variants", variant, "--batch", str(batch), "--seq", str(seq), "--data", args.data]
    env = {**os.environ, "MASTER_PORT": str(free_port())}
    result = None
    spawned = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        for line in proc.stdout or ():
            if line.startswith(RESULT_PREFIX):
                result = RunResult(**json.loads(line.removeprefix(RESULT_PREFIX)))
                reported = time.time()
            else:
                print(line, end="", flush=True)
    ended = time.time()
    if proc.returncode != 0 or result is None:
        print(f"{variant}: the run at batch {batch} x {seq} failed (exit code {proc.returncode}; output above)")
        return None
    result.wall_s, result.exit_s = ended - spawned, ended - reported
    result.startup_s = result.started_at - spawned if result.started_at is not None else None
    print(f"  ({variant}: {phases_text([result])})", flush=True)
    return result


def phases(result: RunResult) -> dict[str, float]:
    """Where a run's wall time went, in order: start-up (interpreter, imports), torch.compile's first call (its
    imports, made before the set-up: ``_mfu_variants.load_compiler``), set-up (meta model to sharded), warm-up
    (compilation), the timed steps, exit, and the rest (process group, data, building, profiling)."""
    parts = {
        "start-up": result.startup_s or 0.0,
        "compile imports": result.compiler_s or 0.0,
        "set-up": result.setup_s or 0.0,
        "warm-up": result.warmup_s or 0.0,
        "timed steps": sum(result.step_s or ()),
        "exit": result.exit_s or 0.0,
    }
    parts["the rest"] = max(0.0, (result.wall_s or 0.0) - sum(parts.values()))
    return parts


def phases_text(results: list[RunResult]) -> str:
    """``"run 37.0 s: start-up 6.0 s, set-up 3.0 s, ..."``: each phase's median over ``results``."""
    wall = statistics.median(r.wall_s or 0.0 for r in results)
    split = [phases(r) for r in results]
    parts = ", ".join(f"{name} {statistics.median(p[name] for p in split):.1f} s" for name in split[0])
    return f"run {wall:.1f} s: {parts}"


def report_time(runs: list[RunResult], elapsed: float) -> None:
    """The ``[time]`` line: how long the benchmark took and where a run's time went (``gpu-check.sh``, which must
    stay under 5 minutes, shows it)."""
    if runs:
        print(f"[time] {len(runs)} runs in {elapsed:.0f} s; median {phases_text(runs)}")


def rounds(args: argparse.Namespace) -> tuple[int, float | None]:
    if args.repeats is None:
        budget = args.time_budget if args.time_budget is not None else DEFAULT_BUDGET_S
        return (1 if args.sweep else DEFAULT_ROUNDS), budget
    return args.repeats, args.time_budget


def header(args: argparse.Namespace, first: RunResult, n: int, batch: str) -> str:
    return (
        f"{first.device}, torch {first.torch_version}, {n / 1e9:.2f}B matmul parameters, {batch},"
        f" {args.steps} timed steps after {args.warmup} (compile {'off' if args.no_compile else 'on'}),"
        f" peak {first.peak_tflops:.1f} TFLOP/s"
    )


def gib(value: float | None) -> str:
    return f"{value:.1f}" if value is not None else "-"


def check_float8() -> str | None:
    """Why this machine cannot run float8 (``_mfu_variants.float8_refusal``), asked in a process of its own: this
    one starts every run and never initializes CUDA. Raises ``RuntimeError`` if that process fails."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--check-float8"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    found = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not found:
        raise RuntimeError(f"the float8 check failed (exit code {done.returncode}):\n{done.stdout}{done.stderr}")
    refusal: str | None = json.loads(found[-1].removeprefix(RESULT_PREFIX))["refusal"]
    return refusal


def compare(args: argparse.Namespace) -> int:
    """The variants in turns, one process per run, then the table; 1 if a run failed or did not fit.

    A variant whose run fails or runs out of memory is left out of the rest and of the table, which the others
    still get: a GPU lent for minutes is not lost to one variant's failure (its output is above the table).
    """
    variants = args.variants.split(",")
    float8 = [v for v in variants if float8_setting(v) is not None]
    refusal = check_float8() if float8 else None
    if refusal is not None:
        variants = [v for v in variants if v not in float8]
        print(f"[summary] float8 not measured ({', '.join(float8)} skipped): {refusal}")
        if set(variants) <= set(args.baselines_added):  # left: only the baselines float8 would have needed
            print("[summary] nothing else to run: bench_mfu.py without --float8 measures bf16 alone")
            return 0
    repeats, budget = rounds(args)
    runs: dict[str, list[RunResult]] = {v: [] for v in variants}
    failed: dict[str, str] = {}
    start = time.perf_counter()
    for r in range(repeats):
        predicted = (time.perf_counter() - start) * (r + 1) / r if r else 0.0  # the rounds so far took the same
        if budget is not None and predicted > budget:
            print(f"(stopped after {r} round(s): one more would end near {predicted:.0f} s, past {budget:.0f} s)")
            break
        for variant in variants[r % len(variants) :] + variants[: r % len(variants)]:
            if variant in failed:
                continue
            result = spawn(args, variant, args.batch, args.seq)
            if result is None or result.oom:
                failed[variant] = "ran out of memory (try a smaller --batch)" if result is not None else "failed"
                print(f"{variant} {failed[variant]} at {args.batch} x {args.seq}: left out of the comparison")
                continue
            runs[variant].append(result)
    elapsed = time.perf_counter() - start
    runs = {v: rs for v, rs in runs.items() if rs and v not in failed}
    if runs and args.setup_only:
        report_setup(args, runs, elapsed)
    elif runs:
        report(args, runs, elapsed)
        if float8 and refusal is None:
            report_float8(args, runs)
        report_time([r for rs in runs.values() for r in rs], elapsed)
    if failed:
        print("\nnot compared: " + "; ".join(f"{v} {why} (its output above)" for v, why in failed.items()))
        return 1
    return 0


def report(args: argparse.Namespace, runs: dict[str, list[RunResult]], elapsed: float) -> None:
    first = next(iter(runs.values()))[0]
    cfg = config(args)
    n = matmul_params(cfg)
    per_token = flops_per_token(cfg, n, args.seq)
    peak = first.peak_tflops * 1e12
    est, setting = estimate(args, args.batch, args.seq)
    recipes = {r.float8 for rs in runs.values() for r in rs if r.float8 is not None}
    float8_est = {recipe: estimate(args, args.batch, args.seq, recipe)[0] for recipe in recipes}
    tps = {v: statistics.median(r.tokens_per_s or 0.0 for r in rs) for v, rs in runs.items()}
    count = min(len(rs) for rs in runs.values())
    print(f"\n{header(args, first, n, f'batch {args.batch} x {args.seq} tokens')}")
    print(
        f"activation checkpointing {args.ac}; every run in its own process, {count} per variant in rotating order;"
        " tokens/s: the median of the runs (each: its median step), min-max over the runs\n"
    )
    print(
        "| variant | tokens/s | MFU (6N+12Lds) | MFU (6N+6Lds, causal) | vs torch by hand | tokens/s min-max"
        " | peak GiB | estimate GiB | set-up s | warm-up s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = tps.get("torch")
    for variant, results in runs.items():
        mfu = [tps[variant] * f / peak for f in per_token]
        ratio = f"{tps[variant] / base:.3f}x" if base else "-"
        spread = [r.tokens_per_s or 0.0 for r in results]
        peaks = [r.peak_gib for r in results if r.peak_gib is not None]
        setup = statistics.median(r.setup_s or 0.0 for r in results)
        warmup = statistics.median(r.warmup_s or 0.0 for r in results)
        print(
            f"| {variant} | {tps[variant]:.0f} | {mfu[0]:.1%} | {mfu[1]:.1%} | {ratio}"
            f" | {min(spread):.0f}-{max(spread):.0f} | {gib(max(peaks) if peaks else None)}"
            f" | {float8_est.get(results[0].float8, est):.1f}"
            f" | {setup:.2f} | {warmup:.1f} |"
        )
    ratios = [
        f"{a} / {label}: {tps[a] / tps[b]:.3f}x"
        for a, b, label in (
            ("modelpar", "torch", "torch by hand"),
            ("modelpar", "lightning", "Lightning"),
            ("torch", "torch-partial", "torch-partial"),
        )
        if a in tps and b in tps
    ]
    if ratios:
        print("\n" + "; ".join(ratios) + " (median tokens/s)")
    setups = {v: statistics.median(r.setup_s or 0.0 for r in rs) for v, rs in runs.items()}
    if setups.get("modelpar") and setups.get("lightning"):
        print(setup_line(runs, setups) + (PROFILED_SETUP if args.profile_setup else ""))
    eager = [v for v, rs in runs.items() if not args.no_compile and any(r.compiled_graphs == 0 for r in rs)]
    if eager:
        print(f"compile was on, but {', '.join(eager)} compiled no graph: it ran eagerly")
    print(
        f"estimate: modelpar.estimate_memory on the meta device for modelpar's layout (1 rank, bf16-mixed policy,"
        f" AdamW), activations for {setting} ({AC_STORES[args.ac]}); Lightning's autocast over fp32 parameters"
        f" is another layout. {sum(map(len, runs.values()))} runs in {elapsed:.0f} s."
    )
    if args.data != "uniform":
        print(f"data: --data {args.data} (the same batches in every run)")
    report_profiles(runs)
    try:
        report_profile_roofline(args, runs)
    except Exception as error:  # the float8 summary printed after it matters more: print it all the same
        print(f"(profile against the roofline not computed: {type(error).__name__}: {error})")


#: Under ``--profile-setup``, after the set-up lines: cProfile slowed every set-up, so the figures compare nothing.
PROFILED_SETUP = "\n  (--profile-setup: every set-up ran under cProfile, which slows it: its seconds measure nothing)"


def report_setup(args: argparse.Namespace, runs: dict[str, list[RunResult]], elapsed: float) -> None:
    """``--setup-only``: each variant's set-up (median, min-max over its runs), torch.compile's imports made before
    it, and the runs' start-up, then the set-up ratios (:func:`setup_line`). A run that only sets up takes the
    start-up, the imports and the set-up (about 13 s on an H200 by 2026-11-28's phases, against about 30 s with its
    steps), so issue 25's ratio gets its spread from several rounds within a lent GPU's minutes."""
    first = next(iter(runs.values()))[0]
    count = min(len(rs) for rs in runs.values())
    compile_text = "off" if args.no_compile else "on, the blocks wrapped (compiled at their first step, not here)"
    print(
        f"\n{first.device}, torch {first.torch_version}, {matmul_params(config(args)) / 1e9:.2f}B matmul parameters,"
        f" set-up only (the meta-device model until it is sharded and materialized, synchronized); compile"
        f" {compile_text}; AC {args.ac}; every run in its own process, {count} per variant in rotating order\n"
    )
    print("| variant | set-up s (median) | set-up min-max | torch.compile's imports s | start-up s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for variant, results in runs.items():
        setup = [r.setup_s or 0.0 for r in results]
        imports = [r.compiler_s for r in results if r.compiler_s is not None]
        startup = [r.startup_s for r in results if r.startup_s is not None]
        peaks = [r.peak_gib for r in results if r.peak_gib is not None]
        print(
            f"| {variant} | {statistics.median(setup):.2f} | {min(setup):.2f}-{max(setup):.2f}"
            f" | {f'{statistics.median(imports):.2f}' if imports else '-'}"
            f" | {f'{statistics.median(startup):.1f}' if startup else '-'} | {gib(max(peaks) if peaks else None)} |"
        )
    setups = {v: statistics.median(r.setup_s or 0.0 for r in rs) for v, rs in runs.items()}
    if setups.get("modelpar") and setups.get("lightning"):
        print("\n" + setup_line(runs, setups) + (PROFILED_SETUP if args.profile_setup else ""))
    elif args.profile_setup:
        print(PROFILED_SETUP)
    print(f"{sum(map(len, runs.values()))} runs in {elapsed:.0f} s.")


def setup_line(runs: dict[str, list[RunResult]], setups: dict[str, float]) -> str:
    """The set-up ratios (modelpar / Lightning against issue 25's goal on a GPU, modelpar / torch by hand), then
    each bf16 variant's set-up, median and min-max over its runs, and torch.compile's first call, which every run
    made before its set-up's timer (``_mfu_variants.load_compiler``): a ratio read from one run per variant was
    1.70x on 2026-11-28 and 1.02-1.09x in the same session's other runs, so the spread is printed beside it."""
    by_hand = f"; modelpar / torch by hand: {setups['modelpar'] / setups['torch']:.2f}x" if setups.get("torch") else ""
    spread = {v: [r.setup_s or 0.0 for r in rs] for v, rs in runs.items()}
    each = [
        f"{v} {setups[v]:.2f} s ({min(spread[v]):.2f}-{max(spread[v]):.2f})"
        for v in ("modelpar", "lightning", "torch")
        if v in setups
    ]
    imports = [r.compiler_s for rs in runs.values() for r in rs if r.compiler_s is not None]
    before = (
        f"; torch.compile's imports, made before the timer in every run: {statistics.median(imports):.2f} s"
        f" ({min(imports):.2f}-{max(imports):.2f})"
        if imports
        else ""
    )
    return (
        f"set-up (meta model to sharded and materialized, synchronized): modelpar / Lightning:"
        f" {setups['modelpar'] / setups['lightning']:.2f}x (goal on a GPU: at most 1.2x){by_hand}\n"
        f"  set-up median (min-max): {', '.join(each)}{before}"
    )


def report_profiles(runs: dict[str, list[RunResult]]) -> None:
    """``--profile``: each variant's device time per step by kernel kind (its first run's profiled steps), and the
    host operators and kernels a step (:data:`PROFILE_COUNTS`)."""
    profiled = {v: rs[0].profile_ms for v, rs in runs.items() if rs and rs[0].profile_ms}
    if not profiled:
        return
    kinds = [k for k in next(iter(profiled.values())) if k not in ("step", "busy", *PROFILE_COUNTS)]
    kinds = [k for k in kinds if any(p.get(k, 0.0) >= 0.005 for p in profiled.values())]
    counts = [c for c in PROFILE_COUNTS if any(c in p for p in profiled.values())]
    print(
        "\nprofile (--profile): ms per step, each variant's first run; 'busy' is the sum of its kernels' device"
        " time (on the CPU smoke check, operators' self CPU time); see each run's busiest kernels above"
        + ("; then counts a step: the aten operators the host called, the kernels that ran" if counts else "")
    )
    print("| variant | step | busy | " + " | ".join(kinds + counts) + " |")
    print("|---|---|---|" + "---|" * len(kinds + counts))
    for variant, ms in profiled.items():
        cells = " | ".join([f"{ms.get(k, 0.0):.2f}" for k in kinds] + [f"{ms.get(c, 0.0):.0f}" for c in counts])
        print(f"| {variant} | {ms['step']:.2f} | {ms['busy']:.2f} | {cells} |")


def loss_curve(results: list[RunResult], warmup: int) -> list[float]:
    """The per-step median over ``results`` of the timed steps' losses (the warm-up steps left out)."""
    curves = [r.losses[warmup:] for r in results if r.losses]
    return [statistics.median(step) for step in zip(*curves, strict=True)] if curves else []


def largest_relative_difference(curve: list[float], baseline: list[float]) -> tuple[float, int | None]:
    """max over steps of ``|curve - baseline| / |baseline|`` and the step (an index into the curves) where it is.

    ``inf`` where a loss is not finite or missing, at the first such step (``None``: a curve missing or shorter);
    the step is ``None`` too where the curves agree at every step. Where it is tells a spike from a drift.
    """
    if not curve or len(curve) != len(baseline):
        return math.inf, None
    worst, at = 0.0, None
    for step, (got, want) in enumerate(zip(curve, baseline, strict=True)):
        if not (math.isfinite(got) and math.isfinite(want)) or want == 0:
            return math.inf, step
        if abs(got - want) / abs(want) > worst:
            worst, at = abs(got - want) / abs(want), step
    return worst, at


def report_float8(args: argparse.Namespace, runs: dict[str, list[RunResult]]) -> None:
    """The float8 comparison as ``[summary]`` lines (``gpu-check.sh``'s summary shows them, up to 200 characters
    each): each bf16 baseline, then each float8 setting against it (``bf16_baseline``: modelpar's against modelpar
    in bf16, ``--by-hand``'s against torch in bf16): tokens/s and their ratio with issue 29's goal, peak memory, the
    roofline, then the loss over the timed steps and its largest relative difference from bf16's, against
    ``--loss-rtol``, with the step where it is; with ``--by-hand``, modelpar's float8 against the same setting by
    hand. Last, outside the summary, every variant's loss curve in full."""
    float8 = {v: setting for v in runs if (setting := float8_setting(v)) is not None}  # variant -> its setting
    if not float8:
        return
    baselines = [b for b in _baselines(float8) if b in runs]
    first = runs[(baselines or list(float8))[0]][0]
    emulated = any(r.emulated for rs in runs.values() for r in rs)
    torchao = next((r.torchao_version for rs in runs.values() for r in rs if r.torchao_version), "?")
    print(
        f"\n[summary] float8 vs bf16 on {first.device}, torch {first.torch_version}, torchao {torchao}, batch"
        f" {args.batch} x {args.seq}, AC {args.ac}, compile {'off' if args.no_compile else 'on'}, --data {args.data},"
        f" {min(len(rs) for rs in runs.values())} run(s) each, losses over {args.steps} timed steps"
    )
    if emulated:
        print("[summary] emulated (no GPU): float8's casts and scales, high-precision multiplies; speeds mean nothing")
    tps = {v: statistics.median(r.tokens_per_s or 0.0 for r in rs) for v, rs in runs.items()}
    for baseline in baselines:
        bf16 = runs[baseline]
        base_curve = loss_curve(bf16, args.warmup)
        noise = ""
        if len(bf16) > 1:
            spread = max(largest_relative_difference(loss_curve([r], args.warmup), base_curve)[0] for r in bf16)
            noise = f" (run to run within {spread:.2%})" if math.isfinite(spread) else ""
        print(f"[summary]   {baseline} bf16: {_speed(bf16)}; loss {_ends(base_curve)}{noise}")
        for variant, setting in float8.items():
            if bf16_baseline(variant) == baseline:
                _float8_lines(args, variant, setting, runs[variant], tps[baseline], base_curve, first.device, emulated)
    for variant in (v for v in float8 if bf16_baseline(v) not in runs):  # its baseline failed: nothing to set against
        print(f"[summary]   {variant}: {_speed(runs[variant])}; no ratio: {bf16_baseline(variant)} in bf16 did not run")
    twins = [(s, v, float8_variant(s, by_hand=True)) for v, s in float8.items() if v == float8_variant(s)]
    by_hand = [f"{s} {tps[v] / tps[twin]:.3f}x" for s, v, twin in twins if tps.get(twin)]
    if by_hand:
        print(f"[summary]   modelpar's float8 / the same by hand (tokens/s): {', '.join(by_hand)}")
    grouped = [v for b in baselines for v in (b, *(f for f in float8 if bf16_baseline(f) == b))]
    print_loss_curves(args, {v: runs[v] for v in dict.fromkeys([*grouped, *float8])})


def print_loss_curves(args: argparse.Namespace, runs: dict[str, list[RunResult]]) -> None:
    """Each variant's loss at every timed step (the per-step median of its runs), one ``[loss]`` line each, in the
    order given.

    The summary gives one figure per curve, the largest gap; the curves beside it tell a single step's spike from
    a drift, and a run's log keeps them for a later look (the runs' own results are not written anywhere else).
    The gpu-check summary leaves ``[loss]`` lines out, as it does ``[time]`` lines, to keep the table in view.
    """
    curves = {v: loss_curve(rs, args.warmup) for v, rs in runs.items()}
    if not any(curves.values()):
        return
    width = max(map(len, curves))
    print(f"\n[loss] at each of the {args.steps} timed steps (each variant: the per-step median of its runs)")
    for variant, curve in curves.items():
        print(f"[loss]   {variant:<{width}}  " + (" ".join(f"{x:.3f}" for x in curve) if curve else "not recorded"))


def _baselines(float8: Iterable[str]) -> list[str]:
    """The bf16 variants the float8 variants ``float8`` are measured against, modelpar's first."""
    return sorted(dict.fromkeys(map(bf16_baseline, float8)), key=lambda b: b != BF16_BASELINE)


def _float8_lines(
    args: argparse.Namespace,
    variant: str,
    setting: str,
    results: list[RunResult],
    base_tps: float,
    base_curve: list[float],
    device: str,
    emulated: bool,
) -> None:
    """One float8 variant's ``[summary]`` lines against its bf16 baseline's tokens/s and loss curve."""
    ratio = statistics.median(r.tokens_per_s or 0.0 for r in results) / base_tps if base_tps else 0.0
    goal = "" if emulated else f" (goal at least {FLOAT8_GOAL}x: {'met' if ratio >= FLOAT8_GOAL else 'NOT met'})"
    print(f"[summary]   {variant}: {_speed(results)}; {ratio:.3f}x bf16's tokens/s{goal}")
    if not emulated:
        try:
            roof = roofline_line(args, setting, device, base_tps)
        except Exception as error:  # the measured lines around it matter more: print them all the same
            roof = f"roofline: not computed ({type(error).__name__}: {error})"
        print(f"[summary]     {roof}")
    curve = loss_curve(results, args.warmup)
    worst, at = largest_relative_difference(curve, base_curve)
    verdict = f"tolerance {args.loss_rtol * 100:g}%: {'within' if worst <= args.loss_rtol else 'OUTSIDE'}"
    where = "" if at is None else f"; largest at timed step {at + 1} of {len(curve)}"
    if math.isfinite(worst):
        where += "" if at is None else f": {curve[at]:.3f} against {base_curve[at]:.3f}"
        print(f"[summary]     loss {_ends(curve)}, within {worst:.2%} of bf16's at every timed step ({verdict}){where}")
    else:
        where = where.replace("largest", "first")
        print(f"[summary]     loss {_ends(curve)}: a loss not finite or missing, its or bf16's ({verdict}){where}")


def model_roofline(args: argparse.Namespace, setting: str, specs: GpuSpecs) -> Roofline:
    """The roofline of the float8 setting (a name of ``FLOAT8_SETTINGS``) on this run's model, batch and ``--ac``."""
    recipe = FLOAT8_SETTINGS[setting][0]
    converted, kept = layer_shapes(config(args), recipe)
    return roofline(converted, args.batch * args.seq, recipe, specs, kept=kept, recompute=args.ac == "full")


def report_profile_roofline(args: argparse.Namespace, runs: dict[str, list[RunResult]]) -> None:
    """``--profile`` with float8 variants on a GPU the roofline knows: each variant's profiled multiplies against
    their roofline, and the rest of its kernels against bf16's, beside the casts' roofline.

    It says where float8's gain went: multiplies far over their roofline point at the kernels (or shapes they run
    badly); a rest far over bf16's by more than the casts' roofline points at the casts and what runs around them
    (unfused kernels, eager code). "the rest" is every kernel but the multiplies and attention (norms, activations,
    casts, the optimizer, copies); on a GPU ``busy`` well under ``step`` means the device waited on the host.
    """
    profiled = {v: rs[0] for v, rs in runs.items() if rs and rs[0].profile_ms}
    float8 = {v: s for v in profiled if (s := float8_setting(v)) is not None and bf16_baseline(v) in profiled}
    if not float8 or any(profiled[v].emulated for v in float8):
        return
    device = next(iter(profiled.values())).device
    specs = specs_for(device)
    if specs is None:
        print(f"(no roofline beside the profile: no specs for {device!r}; known: {', '.join(SPECS)})")
        return

    def multiplies(ms: dict[str, float]) -> float:
        return ms.get("float8 matmul", 0.0) + ms.get("matmul", 0.0)

    def rest(ms: dict[str, float]) -> float:
        return ms["busy"] - multiplies(ms) - ms.get("attention", 0.0)

    print(
        f"\nprofile against the roofline ({device}: {GEMM_EFFICIENCY:.0%} of peak, {BANDWIDTH_EFFICIENCY:.0%} of"
        " bandwidth), ms per step: the multiplies (float8 and bf16 kernels, the output layer's included) measured"
        " and at the roofline; the rest (all kernels but multiplies and attention) and what it adds over its bf16"
        " variant's, beside the casts' roofline"
    )
    columns = ("step", "busy", "multiplies", "roofline", "measured / roofline", "attention", "the rest", "over bf16")
    print("| variant | " + " | ".join(columns) + " | casts' roofline |")
    print("|---|" + "---|" * (len(columns) + 1))
    roofs = {v: model_roofline(args, setting, specs) for v, setting in float8.items()}
    bf16_roof = next(iter(roofs.values()))  # its bf16 multiplies: the same whatever the recipe
    rows: list[tuple[str, Roofline | None]] = []
    for baseline in _baselines(float8):  # each bf16 variant, then its float8 ones
        rows += [(baseline, None), *((v, roof) for v, roof in roofs.items() if bf16_baseline(v) == baseline)]
    for variant, line in rows:
        ms = profiled[variant].profile_ms or {}
        ideal = (bf16_roof.bf16_s + bf16_roof.kept_s) if line is None else (line.float8_s + line.kept_s)
        ideal_ms = ideal * 1e3
        over = "" if line is None else f"{rest(ms) - rest(profiled[bf16_baseline(variant)].profile_ms or {}):+.2f}"
        casts = "" if line is None else f"{line.casts_s * 1e3:.2f}"
        cells = (ms["step"], ms["busy"], multiplies(ms), ideal_ms)
        print(
            f"| {variant} | " + " | ".join(f"{c:.2f}" for c in cells) + f" | {multiplies(ms) / ideal_ms:.2f}x"
            f" | {ms.get('attention', 0.0):.2f} | {rest(ms):.2f} | {over} | {casts} |"
        )


def roofline_line(args: argparse.Namespace, setting: str, device: str, bf16_tokens_per_s: float | None) -> str:
    """What the float8 setting (a name of ``FLOAT8_SETTINGS``) can gain on this model on ``device`` at the roofline
    (``_float8_roofline``): its converted layers and, given bf16's measured tokens/s, the step with the rest of it
    as measured."""
    specs = specs_for(device)
    if specs is None:
        return f"roofline: no specs for {device!r} (known: {', '.join(SPECS)})"
    line = model_roofline(args, setting, specs)
    tokens = args.batch * args.seq
    text = (
        f"roofline ({GEMM_EFFICIENCY:.0%} of peak, {BANDWIDTH_EFFICIENCY:.0%} of bandwidth): {line.layers} float8"
        f" layers {line.linears_speedup:.2f}x"
    )
    if not bf16_tokens_per_s:
        return text
    step_s = tokens / bf16_tokens_per_s
    return (
        f"{text}, the step about {line.step_speedup(step_s):.2f}x (their bf16 multiplies"
        f" {line.bf16_s * 1e3:.0f} ms of its {step_s * 1e3:.0f} ms)"
    )


def print_roofline(args: argparse.Namespace) -> None:
    """``--roofline GPU[:TOKENS_PER_S]``: the roofline of each ``--float8`` setting on this model, running nothing."""
    device, _, tps = args.roofline.partition(":")
    settings = args.float8.split(",") if args.float8 else ["tensorwise", "rowwise"]
    measured = f", bf16 measured at {float(tps):.0f} tokens/s" if tps else ""
    print(
        f"float8 on {device}: dim {args.dim}, {args.layers} layers, FFN {args.ffn}, batch {args.batch} x {args.seq}"
        f"{measured}"
    )
    for setting in settings:
        print(f"  float8-{setting}: {roofline_line(args, setting, device, float(tps) if tps else None)}")


def _speed(results: list[RunResult]) -> str:
    """tokens/s (median, min-max over the runs) and the peak memory."""
    tps = [r.tokens_per_s or 0.0 for r in results]
    peaks = [r.peak_gib for r in results if r.peak_gib is not None]
    spread = f"{min(tps):.0f}-{max(tps):.0f}"
    return f"{statistics.median(tps):.0f} tokens/s ({spread}), peak {gib(max(peaks) if peaks else None)} GiB"


def _ends(curve: list[float]) -> str:
    """The loss at the first and the last timed step."""
    return f"{curve[0]:.3f} -> {curve[-1]:.3f}" if curve else "not recorded"


def sweep(args: argparse.Namespace) -> int:
    """modelpar over batch sizes and sequence lengths, one process per run; out-of-memory runs are noted, skipped.

    Once a batch size runs out of memory, the larger ones at that sequence length are skipped without a run.
    """
    seqs = [int(s) for s in args.sweep_seqs.split(",")]
    tokens = [int(t) for t in args.sweep_tokens.split(",")]
    configs = [(t // seq, seq) for seq in seqs for t in tokens if t >= seq]
    repeats, _ = rounds(args)
    start = time.perf_counter()
    rows: list[tuple[int, int, list[RunResult], str]] = []
    too_large: dict[int, int] = {}  # sequence length -> the smallest batch that ran out of memory
    for batch, seq in configs:
        results: list[RunResult] = []
        note = ""
        if batch > too_large.get(seq, batch):
            rows.append((batch, seq, results, f"skipped: batch {too_large[seq]} ran out of memory"))
            continue
        for _ in range(repeats):
            result = spawn(args, "modelpar", batch, seq)
            if result is None or result.oom:
                note = "out of memory: skipped" if result is not None else "failed: skipped (output above)"
                if result is not None:
                    too_large[seq] = batch
                break
            results.append(result)
        rows.append((batch, seq, results, note))
    measured = [r for row in rows for r in row[2]]
    if not measured:
        print("no configuration of the sweep completed")
        return 1
    first = measured[0]
    n = matmul_params(config(args))
    print(f"\n{header(args, first, n, 'batch x sequence by row')}")
    print(f"modelpar, activation checkpointing {args.ac}, {repeats} run(s) per configuration, each its own process\n")
    print("| batch x seq | tokens/s | MFU (6N+12Lds) | MFU (6N+6Lds, causal) | peak GiB | estimate GiB | set-up s |")
    print("|---|---|---|---|---|---|---|")
    best: tuple[float, str] | None = None
    for batch, seq, results, note in rows:
        est, _ = estimate(args, batch, seq)
        if not results:
            print(f"| {batch} x {seq} | {note} | | | | {est:.1f} | |")
            continue
        tps = statistics.median(r.tokens_per_s or 0.0 for r in results)
        mfu = [tps * f / (first.peak_tflops * 1e12) for f in flops_per_token(config(args, seq), n, seq)]
        peaks = [r.peak_gib for r in results if r.peak_gib is not None]
        setup = statistics.median(r.setup_s or 0.0 for r in results)
        print(
            f"| {batch} x {seq} | {tps:.0f} | {mfu[0]:.1%} | {mfu[1]:.1%} | {gib(max(peaks) if peaks else None)}"
            f" | {est:.1f} | {setup:.2f} |"
        )
        if best is None or tps > best[0]:
            best = (tps, f"batch {batch} x {seq}: {tps:.0f} tokens/s ({mfu[0]:.1%} / {mfu[1]:.1%} causal)")
    elapsed = time.perf_counter() - start
    if best is not None:
        print(f"\nbest on {first.device}: {best[1]}. {len(measured)} runs in {elapsed:.0f} s.")
    report_time(measured, elapsed)
    return 0


def end_worker() -> NoReturn:
    """End a worker process as soon as its result line is out, without the interpreter's teardown.

    Why: the parent waits for the process to end before the next run starts, and the teardown (unloading torch,
    Lightning and transformers, stopping the compiler's worker pool) measures nothing: 1.1-2.5 s a run on CPU,
    measured, with CUDA and NCCL to release besides on a GPU. ``gpu-check.sh``, held to 5 minutes, waited for it
    after every run. The operating system releases the process group's sockets, the device and the files with the
    process; output is flushed first. A worker that fails raises instead, and ends the usual way.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    args = parse()
    if args.roofline is not None:
        print_roofline(args)
        return
    if args.check_float8:
        print(RESULT_PREFIX + json.dumps({"refusal": float8_refusal()}), flush=True)
        end_worker()
    if args.worker:
        run_worker(args)
        end_worker()
    sys.exit(sweep(args) if args.sweep else compare(args))


if __name__ == "__main__":
    main()
