"""Per-rank memory of a layout, computed from a :class:`~modelpar.plans.ParallelPlan` before anything runs.

:func:`estimate_memory` reads only the names, shapes and dtypes of a model (built on the meta device, so it
costs no memory) and the plan's data: which dimension each tensor-parallel style splits, which submodules are
FSDP units. It then shards dim 0 of every parameter over the FSDP shard group exactly as ``fully_shard`` does
(padded chunks of ``ceil(dim0 / shard)`` rows, the same allocation on every rank) and adds up parameters,
gradients, optimizer states and the largest unit while it is all-gathered. No process group, no device.
Given a sequence length it adds the activations (:mod:`modelpar.memory._activations`) and FSDP2's transient buffers
and reports the peak per rank (the rule: :mod:`modelpar.memory._transients`). Mixtures of experts, under expert
parallelism too: :mod:`modelpar.memory._moe`. The per-parameter count is :mod:`modelpar.memory._state`; under pipeline
parallelism it runs per stage and the worst pipeline rank is reported (:mod:`modelpar.memory._pipeline`, the schedules'
timeline: :mod:`modelpar.memory._schedule`).

A plain ``parallelize_fn`` is code, not data: what it does is known only by running it, so it is refused.
The CUDA caching allocator's slack, communication buffers, a prefetched second unit and the rest of
``docs/memory.md``'s list are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from modelpar._mesh.layout import MeshLayout
from modelpar._mesh.sizes import check_size_arg
from modelpar._strategy.precision import SUPPORTED_PRECISIONS
from modelpar._train.fsdp import FSDPOptions
from modelpar._train.grad_sync import AccumulationMode, GradientSyncControl
from modelpar.float8._spec import Float8Recipe, Float8Training
from modelpar.memory._activations import (
    ActivationSetting,
    DecoderShape,
    activation_bytes,
    check_sequence,
    decoder_shape,
    setting_label,
)
from modelpar.memory._compiled import compiled_layers
from modelpar.memory._float8 import choose_layers, float8_decoder_layers, float8_report, unit_casts, with_float8
from modelpar.memory._meta_models import hf_on_meta, llama_on_meta
from modelpar.memory._moe import all_to_all_bytes, expert_units, moe_notes, refuse_hugging_face_experts
from modelpar.memory._pipeline import check_pipeline, estimate_stages
from modelpar.memory._report import MemoryEstimate, dtype_name
from modelpar.memory._state import StateCount, StateRules, count_state
from modelpar.memory._transients import ROOT, worst_moment
from modelpar.plans._checks import resolve_styles, resolve_units
from modelpar.plans._experts import drop_expert_styles, moe_modules
from modelpar.plans._plan import ParallelPlan
from modelpar.plans._units import outermost

__all__ = ["OPTIMIZER_STATES", "MemoryEstimate", "estimate_memory", "hf_on_meta", "llama_on_meta"]

#: Optimizer name -> parameter-shaped state tensors it keeps per parameter, in the parameter's dtype (torch's
#: ``zeros_like(param)`` / ``clone(grad)``): Adam's two moments, SGD's momentum buffer, plain SGD none.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}

#: Precisions whose parameters are stored in a lower dtype (Fabric's ``init_module`` creates them so).
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}


def estimate_memory(
    model: nn.Module,
    *,
    plan: ParallelPlan,
    data_parallel_size: int,
    tensor_parallel_size: int = 1,
    data_parallel_replicate_size: int = 1,
    optimizer: str | int = "adamw",
    precision: str = "32-true",
    mixed_precision: MixedPrecisionPolicy | None = None,
    cpu_offload: bool = False,
    gradient_accumulation: AccumulationMode = "sharded",
    seq_len: int | None = None,
    micro_batch_size: int = 1,
    context_parallel_size: int = 1,
    reshard_after_forward: bool | None = None,
    expert_parallel_size: int = 1,
    accumulate_grad_batches: int = 1,
    pipeline_parallel_size: int = 1,
    pipeline_schedule: str = "1F1B",
    pipeline_microbatches: int | None = None,
    pipeline_stages_per_rank: int | None = None,
    pipeline_split: Sequence[Sequence[str]] | None = None,
    float8: Float8Training | Float8Recipe | None = None,
) -> MemoryEstimate:
    """Bytes per rank that ``plan`` on this layout needs for ``model``'s state, computed without running anything.

    Build the model on the meta device (``with torch.device("meta"): model = Llama(cfg)``); only names, shapes
    and dtypes are read. The arguments mean what the strategy's do; ``mixed_precision`` and ``precision``
    resolve to FSDP2's policy as in the strategy (``"bf16-mixed"``: bf16 all-gathers), and the plan's own
    ``mp_policy`` wins as when it runs. ``optimizer`` is one of :data:`OPTIMIZER_STATES` (``"adamw"``,
    ``"adam"``: two states per parameter; ``"sgd-momentum"``: one; ``"sgd"``: none) or that count as an int;
    states take the parameter's dtype, as torch allocates them (AdamW's scalar ``step`` is not counted).

    Per parameter: the tensor-parallel style of its module splits a dim (column-parallel styles: ``Linear``
    weight and bias dim 0; ``"rowwise"``: weight dim 1, bias replicated; ``"embedding"``: dim 0; ``"norm"``,
    ``"sequence_gather"``: replicated; DTensor ``ColwiseParallel`` / ``RowwiseParallel`` as torch applies them;
    any other ``ParallelStyle`` is counted unsplit, with a note), then FSDP shards dim 0 of what is left over
    the shard group (``data_parallel_size / data_parallel_replicate_size``) in padded chunks. Parameters under
    no FSDP unit belong to the root's. Tied parameters count once. ``gradient_accumulation="unsharded"`` keeps
    unsharded gradients (model / tensor-parallel size) between micro-batches.

    ``seq_len`` (tokens per sample; ``None``: the model state and FSDP2's transients only, no activations),
    ``micro_batch_size`` and ``context_parallel_size`` (each rank holds ``seq_len / cp`` tokens of a sample;
    FSDP shards over the data-parallel shard group x the context-parallel ranks, as torchtitan does) size the
    activations of a Llama-style decoder (:mod:`modelpar.memory._activations`), under the plan's
    ``activation_checkpointing``, ``ac_every``, ``sequence_parallel`` and ``loss_parallel``, in the activation
    dtype (the policy's ``param_dtype``, else the parameters'); the decoder layers the plan compiles
    (``compile=True``) as inductor's partitioner keeps them (:mod:`modelpar.memory._compiled`), the rest as
    eager PyTorch does. ``reshard_after_forward`` is the strategy's
    option (the plan's wins); ``False`` keeps every unit gathered from forward to backward.
    ``expert_parallel_size`` splits the experts of the plan's ``experts`` modules over that many of the ranks
    that shard each replica (``E / ep`` whole experts per rank), FSDP-sharded over the rest, as their own unit;
    MoE layers' activations assume balanced routing, and their all-to-all buffers join the experts' backward
    (:mod:`modelpar.memory._moe`). A Hugging Face MoE, which expert parallelism does not take, is refused above 1.
    ``accumulate_grad_batches`` (the Trainer's name: micro-batches per optimizer step) decides where the
    gradients are at the peak: with 1, ``zero_grad()`` (``set_to_none=True``, torch's default) freed them after
    the last step, and backward writes them while it frees the activations, so the peak counts the larger of the
    two; from 2 on, the earlier micro-batches' gradients are there while the next one's activations are, and both
    count. :attr:`~MemoryEstimate.peak` adds them up (see the module docstring for the rule); ``str()`` prints it
    with its parts.

    ``pipeline_parallel_size`` (``pipeline_schedule``, ``pipeline_microbatches``, ``pipeline_stages_per_rank``,
    ``pipeline_split``: the strategy's options, checked with its messages) cuts the model as the strategy does and
    estimates the pipeline rank whose peak is highest: only its stages' parameters (and their gradients, optimizer
    states, units), the activations of the micro-batches its schedule keeps in flight, the receive buffers, and what
    FSDP2 holds under torch's schedules (every backward but the last runs without gradient sync or resharding). The
    other sizes are per stage, as in the strategy; ``micro_batch_size`` is then the batch each data-parallel rank
    passes to ``pipeline_step``, split into ``pipeline_microbatches`` micro-batches
    (:mod:`modelpar.memory._pipeline`, :mod:`modelpar.memory._schedule`). ``MemoryEstimate.pipeline`` has every
    rank's figures.

    ``float8`` (a recipe name or a :class:`~modelpar.float8.Float8Training`; the strategy's option, handed to the plan
    as the strategy does: it must agree with the plan's own ``float8``) converts the layers
    :func:`modelpar.float8.float8_layers` chooses, as the plan does: their weights all-gathered in float8 under the
    float8 all-gather, fewer activations in compiled layers, and the float8 casts of a layer's backward as a moment of
    their own (:mod:`modelpar.memory._float8`; ``MemoryEstimate.float8``). Master weights, gradients and optimizer
    states stay in high precision.

    Raises ``TypeError`` for a ``plan`` that is not a ``ParallelPlan``, and what ``plan.check`` raises when the
    plan does not fit the model at this tensor-parallel size.
    """
    if not isinstance(plan, ParallelPlan):
        name = getattr(plan, "__name__", type(plan).__name__)
        hint = " (for `parallelize_llama`, pass `modelpar.plans.LLAMA_PLAN`)" if name == "parallelize_llama" else ""
        raise TypeError(
            f"estimate_memory(plan=...) needs a `modelpar.plans.ParallelPlan`, but got {name!r}{hint}. A plain"
            " `parallelize_fn` is code: what it shards is known only by running it on a process group. Describe the"
            " parallelization as a ParallelPlan (tensor_parallel styles and fsdp_units) and pass that."
        )
    plan = with_float8(plan, float8)
    cp = check_sequence(seq_len, micro_batch_size, context_parallel_size, tensor_parallel_size, plan)
    pipeline = check_pipeline(
        pipeline_parallel_size,
        pipeline_schedule,
        pipeline_microbatches,
        pipeline_stages_per_rank,
        pipeline_split,
        micro_batch_size=micro_batch_size,
        seq_len=seq_len,
    )
    pp = pipeline.size if pipeline is not None else 1
    sizes = (data_parallel_size, tensor_parallel_size, data_parallel_replicate_size)
    layout = _layout(*sizes, cp, expert_parallel_size, pp)
    GradientSyncControl(gradient_accumulation)  # validates the mode with the strategy's message
    if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int):
        raise TypeError(
            f"`accumulate_grad_batches={accumulate_grad_batches!r}` must be an int: the micro-batches per optimizer"
            " step (1 without gradient accumulation)."
        )
    if accumulate_grad_batches < 1:
        raise ValueError(
            f"`accumulate_grad_batches={accumulate_grad_batches}` must be at least 1: the micro-batches per optimizer"
            " step (1 without gradient accumulation)."
        )
    states = _optimizer_states(optimizer)
    if precision not in SUPPORTED_PRECISIONS:
        raise ValueError(
            f"`precision={precision!r}` is not supported. Choose one of: {', '.join(SUPPORTED_PRECISIONS)}."
        )
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            f"{type(model).__name__} is already parallelized (it has DTensor parameters). Estimate on a fresh model"
            " built on the meta device: `with torch.device('meta'): model = MyModel(config)`."
        )
    tp, shard = layout.tensor_parallel_size, layout.fsdp_shard_size
    options = FSDPOptions.resolve(
        mixed_precision=mixed_precision,
        cpu_offload=bool(cpu_offload),  # pinning changes where, not how much
        reshard_after_forward=None,
        precision=precision,
        device=torch.device("cpu"),
        shard_size=shard,
        strategy_name="estimate_memory",
    )
    policy = plan.mp_policy if plan.mp_policy is not None else options.mp_policy
    refuse_hugging_face_experts(model, plan.experts, layout.expert_parallel_size)
    plan.check(model, tp, cp, layout.expert_parallel_size)
    choice = choose_layers(model, plan, tp, layout.expert_parallel_size, shard)
    experts = expert_units(model, plan.experts, layout.expert_parallel_size)
    styles = resolve_styles(model, plan.tensor_parallel, sequence_parallel=plan.sequence_parallel) if tp > 1 else {}
    if experts:  # as the plan applies them: under expert parallelism, experts are not tensor-parallel
        styles = drop_expert_styles(styles, moe_modules(model, plan.experts, layout.expert_parallel_size))
    units = resolve_units(model, plan.fsdp_units)
    notes: set[str] = set()
    plan = _checkpointing_as_mode(model, plan, units, notes)

    true_dtype = _TRUE_DTYPES.get(precision)
    float8_weights = choice.gathered_weights if choice is not None else frozenset()
    rules = StateRules(model, layout, styles, experts, units, policy, true_dtype, states, float8_weights)
    resharding = (
        plan.reshard_after_forward if plan.reshard_after_forward is not None else reshard_after_forward
    ) is not False
    whole = count_state(rules, model.named_parameters(), notes)  # deduplicated: a tied parameter appears once
    decoder: DecoderShape | None = None
    activation_args: ActivationSetting | None = None
    casts: dict[str, int] = {}
    if seq_len is not None:
        decoder = decoder_shape(model)
        compiled, why_eager = compiled_layers(model, units, plan, moe=decoder.moe is not None)
        notes |= {why_eager} - {""}
        activation_args = ActivationSetting(
            act_bytes=whole.compute_dtype.itemsize,
            tp=tp,
            cp=cp,
            sequence_parallel=plan.sequence_parallel and tp > 1,
            loss_parallel=plan.loss_parallel and tp > 1,
            checkpointing=str(plan.activation_checkpointing),  # a mode: _checkpointing_as_mode
            ac_every=plan.ac_every,
            compiled=compiled,
            float8=float8_decoder_layers(model, choice) if choice is not None else frozenset(),
        )
        if choice is not None:
            rows = micro_batch_size // (pipeline.microbatches if pipeline is not None else 1) * seq_len // cp
            casts = unit_casts(model, choice, units=units, styles=styles, tp=tp, tokens=rows, compiled=compiled)
    unsharded = gradient_accumulation == "unsharded"

    def buffer_bytes(tensors: Iterable[torch.Tensor]) -> int:
        return sum(
            b.numel() * (true_dtype if true_dtype is not None and b.is_floating_point() else b.dtype).itemsize
            for b in tensors
        )

    def host_bytes(count: StateCount) -> int:
        return (count.sharded + count.optimizer + (0 if unsharded else count.sharded)) if cpu_offload else 0

    def persistent(count: StateCount, buffers: int) -> int:
        """A pipeline rank's persistent device bytes: its sharded state unless offloaded, its buffers, and its sharded
        gradients when they outlive the step (accumulating over steps)."""
        state = 0 if cpu_offload else count.sharded + count.optimizer
        kept = accumulate_grad_batches > 1 and not unsharded and not cpu_offload
        return state + buffers + (count.sharded if kept else 0)

    if pipeline is not None:
        staged = estimate_stages(
            model,
            rules,
            pipeline,
            notes=notes,
            buffer_bytes=buffer_bytes,
            resharding=resharding,
            unsharded_accumulation=unsharded,
            persistent=persistent,
            decoder=decoder,
            activation_args=activation_args,
            micro_batch_size=micro_batch_size,
            seq_len=seq_len,
            float8_casts=casts,
        )
        count, buffers, activations = staged.count, staged.buffers, staged.activations
        moment_name, moment, root, largest = staged.moment_name, staged.moment, staged.root, staged.largest_unit
        batch = micro_batch_size // pipeline.microbatches
    else:
        count = whole
        buffers, batch = buffer_bytes(model.buffers()), micro_batch_size
        activations = None
        if activation_args is not None and decoder is not None and seq_len is not None:
            activations = activation_bytes(decoder, batch=micro_batch_size, seq_len=seq_len, **activation_args)
        extras: dict[str, tuple[tuple[str, int], ...]] = {}
        if activation_args is not None and decoder is not None and decoder.moe is not None and experts:
            a2a = all_to_all_bytes(
                decoder.moe, rows=micro_batch_size * (seq_len or 0), dim=decoder.hidden, a=activation_args["act_bytes"]
            )
            extras = {unit: (("all-to-all send + receive", a2a),) for unit in experts.values()}
        moment_name, moment = worst_moment(
            count.gathered,
            count.reduce_buffer,
            activations,
            resharding=resharding,
            accumulate=unsharded,
            unit_extras=extras,
            unit_gradients=count.unit_gradients,
            float8_casts=casts,
        )
        root = count.gathered.get(ROOT, 0) if resharding else sum(count.gathered.values())
        largest = max(count.gathered, key=lambda u: count.gathered[u]) if count.gathered else ROOT
    unit_bytes = count.gathered.get(largest, 0)
    grads = count.unsharded_grads if unsharded else count.sharded
    param_dtype, compute_dtype = count.param_dtype, count.compute_dtype
    return MemoryEstimate(
        parameters=count.sharded,
        gradients=grads,
        optimizer_states=count.optimizer,
        gathered_unit=unit_bytes,
        unit_gradients=count.unit_gradients.get(largest, 0) if not unsharded else 0,
        buffers=buffers,
        host=host_bytes(count),
        largest_unit=largest,
        layout=layout,
        precision=precision,
        optimizer=f"{optimizer if isinstance(optimizer, str) else 'optimizer'}: {states} x {dtype_name(param_dtype)}",
        gradient_accumulation=gradient_accumulation,
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        notes=tuple(sorted(notes | moe_notes(decoder, layout.expert_parallel_size))),
        root_gathered=root,
        activations=activations,
        moment=moment,
        moment_name=moment_name,
        setting=setting_label(plan, seq_len, batch, cp, tp, dtype_name(compute_dtype)),
        accumulate_grad_batches=accumulate_grad_batches,
        pipeline=staged.pipeline if pipeline is not None else None,
        float8=float8_report(choice, count, activations, casts, largest),
    )


def _layout(
    data_parallel_size: int, tensor_parallel_size: int, data_parallel_replicate_size: int, cp: int, ep: int, pp: int
) -> MeshLayout:
    sizes = {
        "data_parallel_size": data_parallel_size,
        "tensor_parallel_size": tensor_parallel_size,
        "data_parallel_replicate_size": data_parallel_replicate_size,
    }
    for name, value in sizes.items():
        check_size_arg(name, value)
        if isinstance(value, str):  # "auto", which check_size_arg lets through
            raise ValueError(
                f'estimate_memory({name}="auto"): an estimate has no cluster to resolve "auto" against. Pass the'
                " size as an int."
            )
    world = data_parallel_size * tensor_parallel_size * cp * pp
    return MeshLayout.resolve(
        data_parallel_size,
        tensor_parallel_size,
        world_size=world,
        num_nodes=1,
        devices_per_node=world,
        data_parallel_replicate_size=data_parallel_replicate_size,
        context_parallel_size=cp,
        expert_parallel_size=ep,
        pipeline_parallel_size=pp,
    )


def _optimizer_states(optimizer: str | int) -> int:
    if isinstance(optimizer, int) and not isinstance(optimizer, bool) and optimizer >= 0:
        return optimizer
    if isinstance(optimizer, str) and optimizer.lower() in OPTIMIZER_STATES:
        return OPTIMIZER_STATES[optimizer.lower()]
    raise ValueError(
        f"`optimizer={optimizer!r}` is not an optimizer the estimate knows. Pass one of {list(OPTIMIZER_STATES)},"
        " or the number of parameter-shaped state tensors your optimizer keeps per parameter (an int >= 0)."
    )


def _checkpointing_as_mode(model: nn.Module, plan: ParallelPlan, units: list[str], notes: set[str]) -> ParallelPlan:
    """The plan with activation checkpointing by class (or pattern, or predicate) as the mode it amounts to.

    The activation model counts checkpointing per decoder layer: modules selected by class that are the outermost
    FSDP units (FSDP1's usual ``activation_checkpointing_policy={Block}`` beside ``auto_wrap_policy={Block}``) are
    ``"full"``; any other selection is counted as ``"none"`` (an upper bound), and the report says so.
    """
    if isinstance(plan.activation_checkpointing, str):
        return plan
    top = outermost(units)
    mode, checkpointed = plan.checkpointed(model, top)
    if checkpointed == top:
        return plan.replace(activation_checkpointing=mode)
    notes.add(
        "activation checkpointing: the plan checkpoints modules other than its outermost FSDP units; their"
        " activations are counted as if nothing were checkpointed (an upper bound)."
    )
    return plan.replace(activation_checkpointing="none")
