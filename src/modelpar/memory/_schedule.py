"""What a pipeline rank holds over one step: the order torch's schedules run their micro-batches, and the bytes live
after (and during) each of them, from which the estimate takes the worst moment.

**The order** (``torch/distributed/pipelining/schedules.py``, torch 2.13), per pipeline rank ``r`` of ``p``, with
``m`` micro-batches and ``v`` stages per rank:

- ``"GPipe"``: every forward, then every backward: a stage keeps all ``m`` micro-batches.
- ``"1F1B"``: ``min(m, p - r)`` forwards (``Schedule1F1B``'s warm-up), then one backward and one forward in turn
  (the backward first), then the rest of the backwards: stage ``s = r`` keeps at most ``min(m, p - s)``.
- ``"LoopedBFS"``: every forward of the first local stage, then of the next ...; the backwards in reverse: each
  local stage keeps all ``m``.
- ``"Interleaved1F1B"``: ``_get_warmup_ops``: ``w = min((v - 1) q + 2 (p - 1 - r), v m)`` forwards, where ``q`` is
  the micro-batches per round (``m // max(1, m // p)``), local stage ``(op // q) mod v`` for the ``op``-th; then a
  forward and a backward in turn (the forward first; backward local stage ``v - 1 - ((op - w) // q) mod v``), then
  the last ``w`` backwards (``_get_1f1b_rank_ops``). Each forward in flight holds its stage's activations for one
  micro-batch, so rank ``r`` keeps at most ``w + 1`` stage-micro-batches (``w`` if every forward is warm-up).

**What is live** besides the persistent state, as ``PipelineStage`` and FSDP2 keep it: the activations of the
micro-batches in flight and the receive buffers (below); not the last stage's outputs, which torch's schedules keep
to merge after the step unless told not to (``Pipeline.step`` passes ``return_outputs=False``). Under FSDP2 every
backward but the schedule's last runs without gradient sync and without
resharding (``PipelineStage.backward_maybe_with_nosync``: ``set_requires_gradient_sync(False)``,
``set_reshard_after_backward(False)``), so from its first backward on a stage holds its whole unsharded gradients
(in ``reduce_dtype`` when set, else the compute dtype) and, after each backward, every unit gathered (a later
forward reshards them again). After the last backward, ``perform_reduce_grad`` reduce-scatters unit by unit: the
moment is everything gathered, every unsharded gradient and one reduce-scatter input.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PipelineEstimate", "RankUsage", "StageTerms", "in_flight", "rank_peak", "schedule_ops"]

#: One op of a rank's schedule: (position of the stage among the rank's stages, forward?).
Op = tuple[int, bool]
Parts = tuple[tuple[str, int], ...]


def schedule_ops(
    schedule: str, *, rank: int, pipeline_parallel_size: int, per_rank: int, microbatches: int
) -> list[Op]:
    """The forwards and backwards pipeline rank ``rank`` runs in one step, in torch's order (module docstring)."""
    p, v, m = pipeline_parallel_size, per_rank, microbatches
    if schedule == "GPipe":
        return [(0, True)] * m + [(0, False)] * m
    if schedule == "1F1B":
        warmup = min(m, p - rank)
        ops, started = [(0, True)] * warmup, warmup
        for _ in range(m):
            ops.append((0, False))
            if started < m:
                ops.append((0, True))
                started += 1
        return ops
    if schedule == "LoopedBFS":
        forwards = [(k, True) for k in range(v) for _ in range(m)]
        return forwards + [(k, False) for k in reversed(range(v)) for _ in range(m)]
    if schedule == "Interleaved1F1B":
        rounds = max(1, m // p)  # check_schedule_settings refused a count that does not split into them
    else:
        raise ValueError(f"no memory model for `pipeline_schedule={schedule!r}`")  # schedule_spec refused it already
    per_round, total = m // rounds, v * m
    warmup = min((v - 1) * per_round + 2 * (p - 1 - rank), total)

    def forward(op: int) -> Op:
        return (op // per_round) % v, True

    def backward(op: int) -> Op:
        return v - 1 - ((op - warmup) // per_round) % v, False

    steady = [step for op in range(warmup, total) for step in (forward(op), backward(op))]
    return [forward(op) for op in range(warmup)] + steady + [backward(op) for op in range(total, total + warmup)]


def in_flight(ops: list[Op], stages: int) -> tuple[int, ...]:
    """The most micro-batches each of a rank's ``stages`` keeps activations for at once, over ``ops``."""
    live, most = [0] * stages, [0] * stages
    for position, forward in ops:
        live[position] += 1 if forward else -1
        most[position] = max(most[position], live[position])
    return tuple(most)


@dataclass(frozen=True)
class StageTerms:
    """One stage's bytes on its rank (all 0 that do not apply): per micro-batch, and of its FSDP units."""

    index: int
    activations: int  # one micro-batch's, kept from its forward to its backward
    root: int  # the stage's root unit gathered (FSDP2 does not reshard the root after forward)
    units: int  # every unit of the stage gathered
    unsharded_grads: int  # the stage's whole unsharded gradients, accumulated over its micro-batches
    sharded_grads: int  # what the reduce-scatters write at the end
    reduce_input: int  # the largest reduce-scatter input
    cold_moment: tuple[str, Parts]  # worst moment of a backward while the units are resharded
    warm_moment: tuple[str, Parts]  # the same once they are gathered (after this stage's first backward)


@dataclass(frozen=True)
class RankUsage:
    """A pipeline rank at its worst moment: what is live beyond the persistent state, by part."""

    rank: int
    stages: tuple[int, ...]
    in_flight: tuple[int, ...]  # per stage: the most micro-batches whose activations it keeps at once
    moment: str  # when the worst moment is
    activation_parts: Parts  # activations and kept outputs at that moment
    moment_name: str
    moment_parts: Parts  # the backward's transient, if the moment is inside one
    other_parts: Parts  # gathered units, unsharded gradients, receive buffers, reduce-scatter input ...
    most_activations: int  # the most activation bytes (activations and kept outputs) at any moment of the step
    parameters: int = 0  # the rank's stages' sharded state, as MemoryEstimate counts the worst rank's
    gradients: int = 0
    optimizer_states: int = 0

    @property
    def at_peak(self) -> int:
        return sum(size for _, size in (*self.activation_parts, *self.moment_parts, *self.other_parts))


@dataclass(frozen=True)
class PipelineEstimate:
    """The pipeline settings an estimate was made for, and every pipeline rank's usage (the estimate is the worst's)."""

    size: int
    schedule: str
    microbatches: int
    stages_per_rank: int
    micro_batch_size: int | None  # samples per micro-batch (None without a sequence length)
    stage_modules: tuple[tuple[str, ...], ...]  # the cut: module names per stage
    ranks: tuple[RankUsage, ...]
    peaks: tuple[int, ...]  # each pipeline rank's peak (its persistent state and its worst moment)
    worst: int  # the rank with the highest peak

    @property
    def worst_rank(self) -> RankUsage:
        return self.ranks[self.worst]


def _batches(count: int) -> str:
    return f"{count} micro-batch{'es' if count != 1 else ''}"


def rank_peak(
    rank: int,
    stages: list[StageTerms],
    ops: list[Op],
    *,
    resharding: bool,
    gradients_from_start: bool,
    receive_buffers: int,
) -> RankUsage:
    """Walk ``ops`` and return the rank's worst moment (module docstring): after each forward, during and after each
    backward, and at the reduce-scatters after the last backward."""
    n = len(stages)
    live, started = [0] * n, [gradients_from_start] * n
    gathered = ["none"] * n
    best: tuple[int, str, Parts, str, Parts, Parts] | None = None
    most_activations = 0

    def consider(moment: str, moment_name: str = "", moment_parts: Parts = (), extra: Parts = ()) -> None:
        nonlocal best, most_activations
        acts: list[tuple[str, int]] = []
        other: list[tuple[str, int]] = [("p2p receive buffers", receive_buffers)]
        for i, stage in enumerate(stages):
            if live[i]:
                acts.append((f"stage {stage.index}: {_batches(live[i])}", live[i] * stage.activations))
            size = {"none": 0, "root": stage.root, "all": stage.units}[gathered[i]]
            other.append((f"stage {stage.index} gathered: {'every unit' if gathered[i] == 'all' else 'root'}", size))
            if started[i]:
                other.append((f"stage {stage.index} unsharded gradients", stage.unsharded_grads))
        other += extra
        act_parts = tuple((name, size) for name, size in acts if size)
        rest = tuple((name, size) for name, size in other if size)
        most_activations = max(most_activations, sum(size for _, size in act_parts))
        total = sum(size for _, size in (*act_parts, *moment_parts, *rest))
        if best is None or total > best[0]:
            best = (total, moment, act_parts, moment_name, moment_parts, rest)

    for position, forward in ops:
        stage = stages[position]
        if forward:
            live[position] += 1
            gathered[position] = "root" if resharding else "all"
            consider(f"after a forward of stage {stage.index}")
            continue
        name, parts = stage.warm_moment if gathered[position] == "all" else stage.cold_moment
        consider(f"in a backward of stage {stage.index}", name, tuple(p for p in parts if p[1]))
        live[position] -= 1
        started[position] = True
        gathered[position] = "all"
        consider(f"after a backward of stage {stage.index}")
    gathered[:] = ["all"] * n
    started[:] = [True] * n
    largest = max((s.reduce_input for s in stages), default=0)
    consider("the gradient reduce-scatter after the last backward", extra=(("reduce-scatter input", largest),))
    assert best is not None  # ops is never empty: check_schedule_settings asks for at least one micro-batch
    _, moment, act_parts, moment_name, moment_parts, rest = best
    return RankUsage(
        rank=rank,
        stages=tuple(s.index for s in stages),
        in_flight=in_flight(ops, n),
        moment=moment,
        activation_parts=act_parts,
        moment_name=moment_name,
        moment_parts=moment_parts,
        other_parts=rest,
        most_activations=most_activations,
    )
