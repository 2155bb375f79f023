"""Which layouts of a model fit a GPU: every (pipeline parallel, data parallel, replicas, context parallel, tensor
parallel, expert parallel, AC) of a world size, estimated with :func:`~modelpar.estimate_memory`, those whose peak
fits, best first.

The rule, best first: least recomputation (activation checkpointing ``none``, then ``selective``, then
``full``: recomputation costs compute in every step), then the smallest tensor-parallel size, then the smallest
context-parallel size (both add collectives inside every layer, on the critical path), then the smallest
pipeline-parallel size (its bubble idles ``(p - 1) / (m + p - 1)`` of every step, for 1F1B), then the fewest
replicas (HSDP replicas hold a whole copy of the sharded state), then the smallest peak (where expert parallelism
shows: it keeps the sharded state per rank but gathers ``E / ep`` experts instead of all), then the smallest
expert-parallel size. Expert-parallel sizes are tried for plans that split experts (``ParallelPlan.experts``):
those dividing the ranks that shard each replica and every MoE module's experts, with ``cp = 1`` (expert
parallelism refuses context parallelism). Pipeline sizes: the divisors of the world size up to the number of
blocks (times the stages per rank) that the model can be cut into, whose micro-batch count divides
``micro_batch_size`` (then the batch each data-parallel rank splits into micro-batches).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from modelpar._errors import PipelineSplitError
from modelpar.memory._estimate import MemoryEstimate, estimate_memory
from modelpar.memory._float8 import with_float8
from modelpar.memory._pipeline import check_pipeline
from modelpar.pipeline._split import cut_model
from modelpar.plans._experts import experts_name, moe_modules
from modelpar.plans._plan import ParallelPlan

__all__ = ["Fit", "format_fits", "parse_memory", "search_layouts"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AC_ORDER = ("none", "selective", "full")


def parse_memory(text: str) -> int:
    """Bytes from ``"80GiB"``, ``"80GB"``, ``"81920MiB"``, ``"80 gib"`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b|b)?\s*", text, flags=re.IGNORECASE)
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(
            f"--gpu-memory {text!r} is not a memory size. Write a positive number with a unit: 80GiB, 80GB, 81920MiB."
        )
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").lower()])


@dataclass(frozen=True)
class Fit:
    """One layout and its estimate."""

    data_parallel: int
    replicate: int
    context_parallel: int
    tensor_parallel: int
    checkpointing: str
    estimate: MemoryEstimate
    expert_parallel: int = 1
    pipeline_parallel: int = 1

    def rank_key(self) -> tuple[int, int, int, int, int, int, int]:
        return (
            _AC_ORDER.index(self.checkpointing),
            self.tensor_parallel,
            self.context_parallel,
            self.pipeline_parallel,
            self.replicate,
            self.estimate.peak,
            self.expert_parallel,
        )


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _expert_sizes(model: nn.Module, plan: ParallelPlan, shard_ranks: int) -> list[int]:
    """Expert-parallel sizes to try: 1, or for a plan that splits experts those dividing the shard ranks and experts."""
    if not plan.experts:
        return [1]
    modules = moe_modules(model, plan.experts, 1)
    counts = {_n_experts(model.get_submodule(experts_name(model, name))) for name in modules}
    return [ep for ep in _divisors(shard_ranks) if all(n % ep == 0 for n in counts)]


def _n_experts(experts: nn.Module) -> int:
    return next(experts.parameters()).shape[0]


def _pipeline_sizes(
    model: nn.Module,
    world_size: int,
    *,
    micro_batch_size: int,
    seq_len: int,
    schedule: str,
    microbatches: int | None,
    stages_per_rank: int | None,
) -> list[int]:
    """Pipeline sizes to try: 1, and each divisor of the world size whose settings pass the strategy's checks, whose
    micro-batches divide the batch, and into whose stages the model can be cut (at least one block each)."""
    sizes = [1]
    check_pipeline(1, schedule, microbatches, stages_per_rank, None, micro_batch_size=micro_batch_size, seq_len=None)
    for pp in _divisors(world_size)[1:]:
        try:
            settings = check_pipeline(
                pp, schedule, microbatches, stages_per_rank, None, micro_batch_size=micro_batch_size, seq_len=seq_len
            )
            if settings is not None:
                cut_model(model, pp * settings.per_rank)
        except (ValueError, PipelineSplitError):  # too few blocks or micro-batches, tied weights: not a layout
            continue
        sizes.append(pp)
    return sizes


def search_layouts(
    model: nn.Module,
    plan: ParallelPlan,
    *,
    world_size: int,
    gpu_memory: int,
    seq_len: int,
    micro_batch_size: int = 1,
    pipeline_schedule: str = "1F1B",
    pipeline_microbatches: int | None = None,
    pipeline_stages_per_rank: int | None = None,
    **kwargs: object,
) -> tuple[list[Fit], int]:
    """(layouts whose peak fits ``gpu_memory``, best first; how many layouts were tried).

    Tensor-parallel sizes divide the key-value heads (and every dim the plan splits); context-parallel sizes
    divide ``seq_len``; replicas divide the data-parallel size; ``pp x dp x cp x tp = world_size``; expert-parallel
    sizes (plans with ``experts``, ``cp = 1``) divide the ranks sharding each replica and the experts; pipeline sizes
    (with ``pipeline_schedule`` ...) as the module docstring says. ``kwargs`` go to :func:`~modelpar.estimate_memory`
    (``precision``, ``optimizer``, ``float8`` ...; ``float8`` joins the plan first, so that a tensor-parallel size
    whose layers the float8 kernels cannot take is skipped like one the plan cannot split).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--world-size {world_size!r} must be a positive int (the number of GPUs).")
    plan = with_float8(plan, kwargs.pop("float8", None))
    plan.check(model, 1)  # a plan that does not match the model fails here, not silently for every size
    pipeline = {
        "pipeline_schedule": pipeline_schedule,
        "pipeline_microbatches": pipeline_microbatches,
        "pipeline_stages_per_rank": pipeline_stages_per_rank,
    }
    pipeline_sizes = _pipeline_sizes(
        model,
        world_size,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
        schedule=pipeline_schedule,
        microbatches=pipeline_microbatches,
        stages_per_rank=pipeline_stages_per_rank,
    )
    fits: list[Fit] = []
    tried = 0
    for pp in pipeline_sizes:
        stage_ranks = world_size // pp
        for tp in _divisors(stage_ranks):
            try:
                plan.check(model, tp)
            except ValueError:
                continue  # heads or a split dim do not divide: not a layout of this model
            for cp in _divisors(stage_ranks // tp):
                # modelpar.context's load-balanced layout: two chunks per context-parallel rank
                if seq_len % ((2 * cp if cp > 1 else 1) * (tp if plan.sequence_parallel else 1)):
                    continue
                dp = stage_ranks // (tp * cp)
                for replicate in _divisors(dp):
                    for ep in _expert_sizes(model, plan, dp // replicate) if cp == 1 else [1]:
                        for ac in _AC_ORDER:
                            tried += 1
                            estimate = estimate_memory(
                                model,
                                plan=plan.replace(activation_checkpointing=ac),
                                data_parallel_size=dp,
                                tensor_parallel_size=tp,
                                data_parallel_replicate_size=replicate,
                                context_parallel_size=cp,
                                expert_parallel_size=ep,
                                pipeline_parallel_size=pp,
                                seq_len=seq_len,
                                micro_batch_size=micro_batch_size,
                                **pipeline,  # type: ignore[arg-type]
                                **kwargs,  # type: ignore[arg-type]
                            )
                            if estimate.peak <= gpu_memory:
                                fits.append(Fit(dp, replicate, cp, tp, ac, estimate, ep, pp))
    return sorted(fits, key=Fit.rank_key), tried


def format_fits(fits: list[Fit], tried: int, *, world_size: int, gpu_memory: int, limit: int = 20) -> str:
    """The table ``modelpar estimate --search`` prints, or why nothing fits; with a ``pp`` column when a pipeline
    layout fits (without one, the column would read 1 throughout)."""
    gib = 2**30
    head = f"Layouts of {world_size} ranks whose estimated peak fits {gpu_memory / gib:.2f} GiB per rank"
    float8 = next((fit.estimate.float8 for fit in fits if fit.estimate.float8 is not None), None)
    if float8 is not None:
        head += f" in float8 ({float8.recipe})"
    if not fits:
        return (
            f"{head}: none of the {tried} tried fits. Add ranks, shorten --seq-len or --micro-batch, or use"
            " --precision bf16-true / --cpu-offload."
        )
    rule = "best first: least recomputation (AC none < selective < full), then smallest tp, cp, pp, replicas, peak, ep"
    lines = [f"{head} ({len(fits)} of {tried}; {rule}):"]
    pipelined = any(fit.pipeline_parallel > 1 for fit in fits)  # the pp column when a pipeline layout is listed
    names = ("pp", "dp", "replicate", "cp", "tp", "ep")[not pipelined :]
    widths = (4, 4, 9, 4, 4, 4)[not pipelined :]
    lines.append(
        " ".join(f"{name:>{width}}" for name, width in zip(names, widths, strict=True))
        + f" {'AC':>10} {'peak GiB':>9} {'activations':>12}"
    )
    for fit in fits[:limit]:
        e = fit.estimate
        sizes = (
            fit.pipeline_parallel,
            fit.data_parallel,
            fit.replicate,
            fit.context_parallel,
            fit.tensor_parallel,
            fit.expert_parallel,
        )[not pipelined :]
        lines.append(
            " ".join(f"{size:>{width}}" for size, width in zip(sizes, widths, strict=True))
            + f" {fit.checkpointing:>10} {e.peak / gib:>9.2f} {e.stored_activations / gib:>12.2f}"
        )
    if len(fits) > limit:
        lines.append(f"... and {len(fits) - limit} more")
    return "\n".join(lines)
