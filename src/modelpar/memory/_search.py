"""Which layouts of a model fit a GPU: every (data parallel, replicas, context parallel, tensor parallel, expert
parallel, AC) of a world size, estimated with :func:`~modelpar.estimate_memory`, those whose peak fits, best first.

The rule, best first: least recomputation (activation checkpointing ``none``, then ``selective``, then
``full``: recomputation costs compute in every step), then the smallest tensor-parallel size, then the smallest
context-parallel size (both add collectives inside every layer, on the critical path), then the fewest
replicas (HSDP replicas hold a whole copy of the sharded state), then the smallest peak (where expert parallelism
shows: it keeps the sharded state per rank but gathers ``E / ep`` experts instead of all), then the smallest
expert-parallel size. Expert-parallel sizes are tried for plans that split experts (``ParallelPlan.experts``):
those dividing the ranks that shard each replica and every MoE module's experts, with ``cp = 1`` (expert
parallelism refuses context parallelism).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

from modelpar.memory._estimate import MemoryEstimate, estimate_memory
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

    def rank_key(self) -> tuple[int, int, int, int, int, int]:
        return (
            _AC_ORDER.index(self.checkpointing),
            self.tensor_parallel,
            self.context_parallel,
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


def search_layouts(
    model: nn.Module,
    plan: ParallelPlan,
    *,
    world_size: int,
    gpu_memory: int,
    seq_len: int,
    micro_batch_size: int = 1,
    **kwargs: object,
) -> tuple[list[Fit], int]:
    """(layouts whose peak fits ``gpu_memory``, best first; how many layouts were tried).

    Tensor-parallel sizes divide the key-value heads (and every dim the plan splits); context-parallel sizes
    divide ``seq_len``; replicas divide the data-parallel size; ``dp x cp x tp = world_size``; expert-parallel
    sizes (plans with ``experts``, ``cp = 1``) divide the ranks sharding each replica and the experts. ``kwargs`` go to
    :func:`~modelpar.estimate_memory` (``precision``, ``optimizer`` ...).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--world-size {world_size!r} must be a positive int (the number of GPUs).")
    plan.check(model, 1)  # a plan that does not match the model fails here, not silently for every size
    fits: list[Fit] = []
    tried = 0
    for tp in _divisors(world_size):
        try:
            plan.check(model, tp)
        except ValueError:
            continue  # heads or a split dim do not divide: not a layout of this model
        for cp in _divisors(world_size // tp):
            # modelpar.context's load-balanced layout: two chunks per context-parallel rank
            if seq_len % ((2 * cp if cp > 1 else 1) * (tp if plan.sequence_parallel else 1)):
                continue
            dp = world_size // (tp * cp)
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
                            seq_len=seq_len,
                            micro_batch_size=micro_batch_size,
                            **kwargs,  # type: ignore[arg-type]
                        )
                        if estimate.peak <= gpu_memory:
                            fits.append(Fit(dp, replicate, cp, tp, ac, estimate, ep))
    return sorted(fits, key=Fit.rank_key), tried


def format_fits(fits: list[Fit], tried: int, *, world_size: int, gpu_memory: int, limit: int = 20) -> str:
    """The table ``modelpar estimate --search`` prints, or why nothing fits."""
    gib = 2**30
    head = f"Layouts of {world_size} ranks whose estimated peak fits {gpu_memory / gib:.2f} GiB per rank"
    if not fits:
        return (
            f"{head}: none of the {tried} tried fits. Add ranks, shorten --seq-len or --micro-batch, or use"
            " --precision bf16-true / --cpu-offload."
        )
    rule = "best first: least recomputation (AC none < selective < full), then smallest tp, cp, replicas, peak, ep"
    lines = [f"{head} ({len(fits)} of {tried}; {rule}):"]
    lines.append(
        f"{'dp':>4} {'replicate':>9} {'cp':>4} {'tp':>4} {'ep':>4} {'AC':>10} {'peak GiB':>9} {'activations':>12}"
    )
    for fit in fits[:limit]:
        e = fit.estimate
        sizes = (fit.data_parallel, fit.replicate, fit.context_parallel, fit.tensor_parallel, fit.expert_parallel)
        lines.append(
            " ".join(f"{size:>{width}}" for size, width in zip(sizes, (4, 9, 4, 4, 4), strict=True))
            + f" {fit.checkpointing:>10} {e.peak / gib:>9.2f} {e.stored_activations / gib:>12.2f}"
        )
    if len(fits) > limit:
        lines.append(f"... and {len(fits) - limit} more")
    return "\n".join(lines)
