"""The pipeline schedules offered, by torch's names, and the checks a schedule's settings must pass.

Every schedule of ``torch.distributed.pipelining`` that trains exactly as one process does is offered: each was
run on gloo against one process in ``tests/distributed/test_pipeline.py``. The zero-bubble ones
(``"InterleavedZeroBubble"``, ``"ZBVZeroBubble"``, ``"DualPipeV"``) run, but their split backward loses part
of the weight gradients under FSDP2, so they are refused with that reason (:data:`OFFERED_SCHEDULES`: the others).

What differs between them is
how many stages a rank holds and where: the single-stage schedules (``"GPipe"``, ``"1F1B"``) one stage per rank; the
looped ones several, either round-robin (``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``: rank
``r`` holds stages ``r, r + pp, r + 2 pp ...``) or in a V (``"ZBVZeroBubble"``, ``"DualPipeV"``: exactly two per rank,
``r`` and ``2 pp - 1 - r``, so the first and last stage sit on rank 0).

The checks are pure arithmetic on the strategy's options and the model's layer count, so every rank raises the same
error before any collective. Fewer micro-batches than stages is refused for every schedule: torch's single-stage
schedules hang on it (torchtitan #775) and its looped ones refuse it only once they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "OFFERED_SCHEDULES",
    "PIPELINE_SCHEDULES",
    "ScheduleSpec",
    "check_schedule_settings",
    "schedule_spec",
    "stage_ids",
]

Placement = Literal["single", "loop", "v"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule: its torch name, how stages are placed on ranks, and what fraction of a step is bubble.

    ``bubble`` is the idle fraction of one step with ``m`` micro-batches, ``p`` ranks and ``v`` stages per rank,
    as the schedule's papers state it (``docs/pipeline.md`` tabulates them).
    """

    name: str
    placement: Placement
    #: Activations of how many micro-batches a stage keeps at most, given (stage index, stages, micro-batches).
    in_flight: str
    bubble: str
    #: Why the schedule is refused, when it is: the test against one process that it failed.
    refused: str | None = None

    @property
    def looped(self) -> bool:
        return self.placement != "single"

    def torch_class(self) -> Any:
        from torch.distributed.pipelining.schedules import get_schedule_class

        return get_schedule_class(self.name)


_ZERO_BUBBLE = (
    "its backward split in two (input gradients, then weight gradients) loses part of the weight gradients under"
    " FSDP2 (torch 2.13, 2 stages on gloo: gradient norm 0.564 against one process's 0.613, where the other schedules"
    " match it to 1e-7)"
)

#: The schedules known, by the names ``torch.distributed.pipelining.schedules.get_schedule_class`` takes.
PIPELINE_SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("GPipe", "single", "all micro-batches", "(p - 1) / (m + p - 1)"),
        ScheduleSpec("1F1B", "single", "p - stage", "(p - 1) / (m + p - 1)"),
        ScheduleSpec("Interleaved1F1B", "loop", "about p - rank per stage", "(p - 1) / (v m + p - 1)"),
        ScheduleSpec("LoopedBFS", "loop", "all micro-batches", "(p - 1) / (v m + p - 1)"),
        ScheduleSpec("InterleavedZeroBubble", "loop", "about p - rank per stage", "close to 0", _ZERO_BUBBLE),
        ScheduleSpec("ZBVZeroBubble", "v", "about p - rank per stage", "close to 0", _ZERO_BUBBLE),
        ScheduleSpec("DualPipeV", "v", "about p - rank per stage", "close to 0", _ZERO_BUBBLE),
    )
}


#: The schedules offered: those that train exactly as one process does (``tests/distributed/test_pipeline.py``).
OFFERED_SCHEDULES: tuple[str, ...] = tuple(name for name, spec in PIPELINE_SCHEDULES.items() if spec.refused is None)


def schedule_spec(name: object) -> ScheduleSpec:
    """The schedule called ``name``: ``ValueError`` for an unknown name, ``NotImplementedError`` for a refused one."""
    if not isinstance(name, str) or name not in PIPELINE_SCHEDULES:
        raise ValueError(
            f"`pipeline_schedule={name!r}` is not a schedule. Use one of {list(OFFERED_SCHEDULES)}"
            " (torch.distributed.pipelining's names)."
        )
    spec = PIPELINE_SCHEDULES[name]
    if spec.refused is not None:
        raise NotImplementedError(
            f"`pipeline_schedule={name!r}` is not offered: {spec.refused}. Use one of {list(OFFERED_SCHEDULES)}:"
            " `'Interleaved1F1B'` has the smallest bubble of those."
        )
    return spec


def stages_per_rank(spec: ScheduleSpec, given: int | None) -> int:
    """Stages each rank holds: 1 for a single-stage schedule, 2 for a V, the given number (default 2) for a loop."""
    if spec.placement == "single":
        return 1
    if spec.placement == "v":
        return 2
    return 2 if given is None else given


def check_schedule_settings(
    spec: ScheduleSpec, *, pipeline_parallel_size: int, stages_per_rank_arg: int | None, microbatches: int | None
) -> tuple[int, int]:
    """Validate the schedule's settings and return (stages per rank, micro-batches); ``ValueError`` with the fix."""
    if stages_per_rank_arg is not None and (
        isinstance(stages_per_rank_arg, bool) or not isinstance(stages_per_rank_arg, int) or stages_per_rank_arg < 1
    ):
        raise ValueError(f"`pipeline_stages_per_rank={stages_per_rank_arg!r}` must be a positive integer or None.")
    if spec.placement == "single" and stages_per_rank_arg not in (None, 1):
        raise ValueError(
            f"`pipeline_schedule={spec.name!r}` runs one stage per rank, but `pipeline_stages_per_rank="
            f"{stages_per_rank_arg}` was given. Use a looped schedule (`'Interleaved1F1B'`, `'LoopedBFS'`,"
            " `'InterleavedZeroBubble'`) for several stages per rank, or leave `pipeline_stages_per_rank` out."
        )
    if spec.placement == "loop" and stages_per_rank_arg == 1:
        raise ValueError(
            f"`pipeline_schedule={spec.name!r}` loops over several stages per rank, but `pipeline_stages_per_rank=1`"
            " was given: it would run as a slower 1F1B. Give it 2 or more stages per rank, or use"
            " `pipeline_schedule='1F1B'`."
        )
    if spec.placement == "v" and stages_per_rank_arg not in (None, 2):
        raise ValueError(
            f"`pipeline_schedule={spec.name!r}` places exactly 2 stages per rank (in a V), but"
            f" `pipeline_stages_per_rank={stages_per_rank_arg}` was given. Leave it out, or use `'Interleaved1F1B'`."
        )
    per_rank = stages_per_rank(spec, stages_per_rank_arg)
    stages = pipeline_parallel_size * per_rank
    if microbatches is not None and (isinstance(microbatches, bool) or not isinstance(microbatches, int)):
        raise ValueError(f"`pipeline_microbatches={microbatches!r}` must be a positive integer or None.")
    count = stages if microbatches is None else microbatches
    if count < stages:
        raise ValueError(
            f"`pipeline_microbatches={count}` is fewer than the {stages} pipeline stages"
            f" (`pipeline_parallel_size={pipeline_parallel_size}` x {per_rank} per rank): the pipeline would never"
            f" fill, and torch's schedules hang or fail on it. Use at least {stages} micro-batches (more shrink the"
            " bubble)."
        )
    rounds = max(1, count // pipeline_parallel_size)
    if spec.name == "Interleaved1F1B" and count % rounds:
        fits = [m for m in range(stages, 4 * stages + 1) if m % max(1, m // pipeline_parallel_size) == 0][:6]
        raise ValueError(
            f"`pipeline_microbatches={count}` does not split into the rounds `'Interleaved1F1B'` runs: their number"
            f" (micro-batches // `pipeline_parallel_size` = {count} // {pipeline_parallel_size} = {rounds}) must"
            f" divide the micro-batches, and torch refuses it when the schedule is built. Use for example one of"
            f" {fits}."
        )
    return per_rank, count


def stage_ids(spec: ScheduleSpec, *, rank: int, pipeline_parallel_size: int, per_rank: int) -> list[int]:
    """The stage indices pipeline rank ``rank`` holds, in the order the schedule wants them."""
    pp = pipeline_parallel_size
    if spec.placement == "v":
        return [rank, 2 * pp - 1 - rank]
    return [rank + k * pp for k in range(per_rank)]
