"""Pipeline parallelism in the estimate: the model cut as the strategy cuts it, each pipeline rank's stages counted
on their own, the rank whose peak is highest reported.

Per stage (``modelpar.pipeline.cut_model``: the same cut, from names and shapes), as the strategy sets it up:

- **State**: the stage's parameters only, tensor-parallel and FSDP-sharded as before (:mod:`modelpar.memory._state`),
  with the stage as its own FSDP root (the embedding on the first, the final norm and output layer on the last);
  buffers of the stage's modules and of the modules every stage shares (rotary tables), once per rank.
- **Activations of one micro-batch** (``micro_batch_size / pipeline_microbatches`` samples): those of the decoder
  layers the stage holds (:func:`~modelpar.memory._activations.activation_bytes`), the token ids on the first stage,
  the final norm, logits and loss on the last; plus, on every stage but the last, its output (the hidden state sent
  on), which ``PipelineStage`` keeps until the micro-batch's backward; less, on every stage but the first, the
  received input where the first layer keeps it itself (fp32 norms, checkpointed or compiled layers), since the
  receive buffers below hold it.
- **Receive buffers**: ``PipelineStage`` allocates one buffer per micro-batch for the hidden state it receives
  (every stage but the first) and one for the gradient it receives (every stage but the last), each
  ``micro-batch x local tokens x hidden`` in the activation dtype, kept from the first step on (torch 2.13).
- **How many micro-batches are in flight**, and what FSDP2 holds between them: :mod:`modelpar.memory._schedule`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from modelpar._mesh.sizes import check_pipeline_parallel_size
from modelpar.memory._activations import ActivationEstimate, ActivationSetting, DecoderShape, activation_bytes
from modelpar.memory._moe import all_to_all_bytes
from modelpar.memory._schedule import PipelineEstimate, RankUsage, StageTerms, rank_peak, schedule_ops
from modelpar.memory._state import StateCount, StateRules, count_state
from modelpar.memory._transients import ROOT, worst_moment
from modelpar.pipeline._schedules import ScheduleSpec, check_schedule_settings, schedule_spec, stage_ids
from modelpar.pipeline._split import StageCut, cut_model
from modelpar.plans._units import repeated_blocks

__all__ = ["PipelineSettings", "Staged", "check_pipeline", "estimate_stages"]

_FP32 = 4


@dataclass(frozen=True)
class PipelineSettings:
    """The pipeline arguments of an estimate, checked as the strategy checks them."""

    size: int
    spec: ScheduleSpec
    per_rank: int
    microbatches: int
    split: Sequence[Sequence[str]] | None


def check_pipeline(
    size: object,
    schedule: object,
    microbatches: int | None,
    stages_per_rank: int | None,
    split: Sequence[Sequence[str]] | None,
    *,
    micro_batch_size: int,
    seq_len: int | None,
) -> PipelineSettings | None:
    """Validate the pipeline arguments with the strategy's checks (and messages); ``None`` without a pipeline."""
    pp = check_pipeline_parallel_size(size)
    spec = schedule_spec(schedule)
    per_rank, count = check_schedule_settings(
        spec, pipeline_parallel_size=pp, stages_per_rank_arg=stages_per_rank, microbatches=microbatches
    )
    if pp == 1:
        return None
    if seq_len is not None and micro_batch_size % count:
        raise ValueError(
            f"estimate_memory(micro_batch_size={micro_batch_size}): under pipeline parallelism it is the batch each"
            f" data-parallel rank passes to `pipeline_step`, which splits it into `pipeline_microbatches={count}`"
            f" equal micro-batches. Use a batch that is a multiple of {count}, or change `pipeline_microbatches`."
        )
    schedule_ops(
        spec.name, rank=0, pipeline_parallel_size=pp, per_rank=per_rank, microbatches=count
    )  # torch's refusals
    return PipelineSettings(pp, spec, per_rank, count, split)


@dataclass(frozen=True)
class Staged:
    """The worst pipeline rank: its stages' state summed, its activations and backward moment at its worst moment."""

    count: StateCount
    buffers: int
    activations: ActivationEstimate | None
    moment_name: str
    moment: tuple[tuple[str, int], ...]
    root: int
    largest_unit: str
    pipeline: PipelineEstimate


def estimate_stages(
    model: nn.Module,
    rules: StateRules,
    settings: PipelineSettings,
    *,
    notes: set[str],
    buffer_bytes: Callable[[Iterable[torch.Tensor]], int],
    resharding: bool,
    unsharded_accumulation: bool,
    persistent: Callable[[StateCount, int], int],
    decoder: DecoderShape | None,
    activation_args: ActivationSetting | None,
    micro_batch_size: int,
    seq_len: int | None,
    float8_casts: dict[str, int],
) -> Staged:
    """Count every pipeline rank's stages and return the worst rank (the highest peak).

    ``buffer_bytes(tensors)`` sizes buffers in their stored dtype; ``persistent(count, buffers)`` is a rank's
    persistent device bytes (parameters, optimizer states, buffers, and the gradients when they persist), which
    together with the moment :func:`~modelpar.memory._schedule.rank_peak` finds makes the rank's peak.
    ``float8_casts``: per FSDP unit, the float8 casts of its worst layer's backward (:mod:`modelpar.memory._float8`).
    """
    pp, per_rank, m = settings.size, settings.per_rank, settings.microbatches
    cut = cut_model(model, pp * per_rank, settings.split)
    last = len(cut.stages) - 1
    layers = _stage_layers(model, cut)
    micro = micro_batch_size // m
    counts = {s: count_state(rules, _stage_parameters(model, names), notes) for s, names in enumerate(cut.stages)}
    stream = 0
    if activation_args is not None and decoder is not None and seq_len is not None:
        tp, cp = activation_args["tp"], activation_args["cp"]
        rows = micro * seq_len // cp
        stream = (rows // tp if activation_args["sequence_parallel"] else rows) * decoder.hidden
        stream *= activation_args["act_bytes"]
    terms: dict[int, tuple[StageTerms, ActivationEstimate | None]] = {}
    for s in range(len(cut.stages)):
        terms[s] = _stage_terms(
            s,
            counts[s],
            layers[s],
            last=last,
            resharding=resharding,
            decoder=decoder,
            stream=stream,
            activation_args=activation_args,
            micro=micro,
            seq_len=seq_len,
            experts=set(rules.experts.values()),
            float8_casts=float8_casts,
        )
    usages: list[RankUsage] = []
    totals: list[int] = []
    rank_buffers: list[int] = []
    for rank in range(pp):
        ids = stage_ids(settings.spec, rank=rank, pipeline_parallel_size=pp, per_rank=per_rank)
        ops = schedule_ops(settings.spec.name, rank=rank, pipeline_parallel_size=pp, per_rank=per_rank, microbatches=m)
        receive = sum(m * stream * ((s > 0) + (s < last)) for s in ids)
        usage = rank_peak(
            rank,
            [terms[s][0] for s in ids],
            ops,
            resharding=resharding,
            gradients_from_start=unsharded_accumulation,
            receive_buffers=receive,
        )
        state = _merge([counts[s] for s in ids])
        grads = state.unsharded_grads if unsharded_accumulation else state.sharded
        usage = replace(usage, parameters=state.sharded, gradients=grads, optimizer_states=state.optimizer)
        modules = {
            id(b): b for s in ids for n in (*cut.stages[s], *cut.shared) for b in model.get_submodule(n).buffers()
        }
        buffers = buffer_bytes(modules.values())
        usages.append(usage)
        rank_buffers.append(buffers)
        totals.append(persistent(state, buffers) + usage.at_peak)
    worst = max(range(pp), key=lambda r: totals[r])
    usage = usages[worst]
    count = _merge([counts[s] for s in usage.stages])
    gathered = _by_stage(counts, usage.stages, "gathered")
    largest = max(gathered, key=lambda u: gathered[u]) if gathered else ROOT
    count.gathered = gathered
    count.unit_gradients = _by_stage(counts, usage.stages, "unit_gradients")
    count.received = _by_stage(counts, usage.stages, "received")
    count.received_without_float8 = _by_stage(counts, usage.stages, "received_without_float8")
    own = [terms[s][1] for s in usage.stages]
    activations = None
    if all(a is not None for a in own) and own:
        activations = ActivationEstimate(
            parts=usage.activation_parts,
            recompute=max(a.recompute for a in own if a is not None),
            loss_backward=max(a.loss_backward for a in own if a is not None),
            layers=sum(a.layers for a in own if a is not None),
            compiled_layers=sum(a.compiled_layers for a in own if a is not None),
            float8_saved=sum(a.float8_saved for a in own if a is not None),
        )
    pipeline = PipelineEstimate(
        size=pp,
        schedule=settings.spec.name,
        microbatches=m,
        stages_per_rank=per_rank,
        micro_batch_size=micro if seq_len is not None else None,
        stage_modules=cut.stages,
        ranks=tuple(usages),
        peaks=tuple(totals),
        worst=worst,
    )
    return Staged(
        count=count,
        buffers=rank_buffers[worst],
        activations=activations,
        moment_name=usage.moment_name,
        moment=usage.moment_parts,
        root=sum(counts[s].gathered.get(ROOT, 0) for s in usage.stages),
        largest_unit=largest,
        pipeline=pipeline,
    )


def _stage_terms(
    stage: int,
    count: StateCount,
    layer_ids: list[int],
    *,
    last: int,
    resharding: bool,
    decoder: DecoderShape | None,
    stream: int,
    activation_args: ActivationSetting | None,
    micro: int,
    seq_len: int | None,
    experts: set[str],
    float8_casts: dict[str, int],
) -> tuple[StageTerms, ActivationEstimate | None]:
    """One stage's :class:`StageTerms`, and its activations of one micro-batch."""
    acts, per_batch = None, 0
    extras: dict[str, tuple[tuple[str, int], ...]] = {}
    if activation_args is not None and decoder is not None and seq_len is not None:
        args = activation_args
        first_last = {"first": stage == 0, "last": stage == last}
        acts = activation_bytes(decoder, batch=micro, seq_len=seq_len, **args, layer_ids=layer_ids, **first_last)
        per_batch = acts.stored + (stream if stage < last else 0)  # the output PipelineStage keeps for backward
        if stage > 0 and layer_ids and _keeps_its_input(layer_ids[0], args):
            per_batch -= stream  # the received hidden state, which the receive buffers count
        if decoder.moe is not None and experts:
            a2a = all_to_all_bytes(decoder.moe, rows=micro * seq_len, dim=decoder.hidden, a=args["act_bytes"])
            extras = {unit: (("all-to-all send + receive", a2a),) for unit in experts}
    no_reduce = dict.fromkeys(count.gathered, 0)  # no reduce-scatter in a micro-batch's backward under the pipeline
    moments = [
        worst_moment(
            count.gathered,
            no_reduce,
            acts,
            resharding=cold,
            accumulate=False,
            unit_extras=extras,
            unit_gradients=count.unit_gradients,
            float8_casts={unit: size for unit, size in float8_casts.items() if unit in count.gathered},
        )
        for cold in (resharding, False)
    ]
    term = StageTerms(
        index=stage,
        activations=per_batch,
        root=count.gathered.get(ROOT, 0),
        units=sum(count.gathered.values()),
        unsharded_grads=count.unsharded_grads,
        sharded_grads=count.sharded,
        reduce_input=max(count.reduce_buffer.values(), default=0),
        cold_moment=moments[0],
        warm_moment=moments[1],
    )
    return term, acts


def _keeps_its_input(layer: int, args: ActivationSetting) -> bool:
    """Whether a decoder layer keeps its input tensor itself for backward: an fp32 RMSNorm saves it (``x.float()`` is
    ``x``), a checkpointed layer keeps its input, and so does a compiled one (:mod:`modelpar.memory._compiled`)."""
    checkpointed = args["checkpointing"] != "none" and args["ac_every"] == 1
    return args["act_bytes"] == _FP32 or checkpointed or layer in args["compiled"]


def _stage_parameters(model: nn.Module, names: Sequence[str]) -> list[tuple[str, nn.Parameter]]:
    """The parameters of a stage's modules under their whole-model names, each tensor once."""
    seen: set[int] = set()
    found = []
    for name in names:
        for local, param in model.get_submodule(name).named_parameters():
            if id(param) not in seen:
                seen.add(id(param))
                found.append((f"{name}.{local}", param))
    return found


def _stage_layers(model: nn.Module, cut: StageCut) -> list[list[int]]:
    """Per stage, the indices of the decoder layers it holds (a layer some of whose modules it names counts there)."""
    found = repeated_blocks(model)
    blocks = list(found.names) if found is not None else []
    layers: list[list[int]] = [[] for _ in cut.stages]
    for index, block in enumerate(blocks):
        for stage, names in enumerate(cut.stages):
            if any(n == block or n.startswith(block + ".") for n in names):
                layers[stage].append(index)
                break
    return layers


def _by_stage(counts: dict[int, StateCount], stages: Sequence[int], attribute: str) -> dict[str, int]:
    """A per-unit figure of several stages, keyed by stage and unit."""
    return {f"stage {s} {unit}": size for s in stages for unit, size in getattr(counts[s], attribute).items()}


def _merge(counts: list[StateCount]) -> StateCount:
    """Several stages' counts as one rank's (units keyed by stage)."""
    merged = StateCount()
    for count in counts:
        merged.sharded += count.sharded
        merged.optimizer += count.optimizer
        merged.unsharded_grads += count.unsharded_grads
        merged.param_dtype, merged.compute_dtype = count.param_dtype, count.compute_dtype
    return merged
