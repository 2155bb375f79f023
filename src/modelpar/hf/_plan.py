"""A :class:`~modelpar.plans.ParallelPlan` read from a Hugging Face model's own tensor-parallel plan.

``transformers`` ships, for most decoder families, a tensor-parallel plan in data: the config's
``base_model_tp_plan`` (patterns relative to the base model, ``"layers.*.self_attn.q_proj": "colwise"``) and
the model class's ``_tp_plan`` for its head (``{"lm_head": "colwise_gather_output"}``). :func:`plan_for`
translates both into our style names, names the decoder layers (``_no_split_modules``) as FSDP units, and
passes the plan's options through. The plan is data: build it from a meta-device model before the strategy
sets the model up, and pass it as the ``parallelize_fn``.
"""

from __future__ import annotations

import re

from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from modelpar.float8 import Float8Recipe, Float8Training
from modelpar.hf._styles import (
    HF_REFUSED,
    HF_STYLES,
    SKIP,
    RefusedStyle,
    RefusedStyleError,
    refused,
    translate,
)
from modelpar.plans import ActivationCheckpointing, ParallelPlan
from modelpar.plans._checks import matches
from modelpar.plans._styles import StyleSpec
from modelpar.plans._units import unsplit_modules

__all__ = ["HF_REFUSED", "HF_STYLES", "plan_for"]


def plan_for(
    model: nn.Module,
    *,
    activation_checkpointing: ActivationCheckpointing = "none",
    ac_every: int = 1,
    compile: bool = False,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    reshard_after_forward: bool | int | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    float8: Float8Training | Float8Recipe | None = None,
) -> ParallelPlan:
    """The :class:`~modelpar.plans.ParallelPlan` of a Hugging Face ``PreTrainedModel``, from its own TP plan.

    ``model`` may be on the meta device (build it under ``fabric.init_module(empty_init=True)`` or
    ``torch.device("meta")``); only its names, types, config and class are read. The plan:

    - tensor parallelism from ``model.config.base_model_tp_plan`` (prefixed with ``model.base_model_prefix``
      when the model has a head) and the class's ``_tp_plan``, each style translated as :data:`HF_STYLES` says:
      ``"colwise"`` -> ``"colwise"``, ``"rowwise"`` -> ``"rowwise"``, ``"colwise_gather_output"`` -> ``"output"``
      on the LM head (vocab-sharded logits with ``loss_parallel``), ``"colwise_gather"`` elsewhere,
      ``"rowwise_split_input"`` -> a row-parallel layer that splits its replicated input locally,
      ``"embedding_rowwise"`` -> ``"embedding"``, ``"sequence_parallel"`` -> ``"norm"``,
      ``"replicated_with_grad_allreduce"`` (Qwen3's per-head ``q_norm`` / ``k_norm``) -> parameters replicated
      on the tensor-parallel ranks, the input marked as split over heads, so each rank's partial gradient is
      summed; ``"mla_kv_a_proj"`` -> replicated, the rope part's gradient summed. Entries matching nothing in
      this model are left out, as transformers does. ``"moe_tp_experts"`` (a MoE layer's experts module) ->
      whole experts per tensor-parallel rank, their outputs summed once (``docs/moe.md``). The styles in
      :data:`HF_REFUSED` (packed projections outside an experts module ...) stay in the plan as placeholders:
      without tensor parallelism the plan shards with FSDP alone; with ``tensor_parallel_size > 1`` its check
      raises :class:`~modelpar.hf.RefusedStyleError` (a ``ValueError`` and ``NotImplementedError``) with the
      reason, before anything is sharded. An unknown style is a ``ValueError`` at once;
    - experts: the experts modules of the config's ``base_model_ep_plan`` (``"ep_dispatch_experts"``) become the
      plan's ``experts``, split over the expert axis under ``expert_parallel_size > 1``;
    - with tied word embeddings the LM head keeps its (shared) weight replicated, since sharding it would
      untie it; ``loss_parallel`` then has nothing to shard and is refused;
    - FSDP units: the modules of the classes in ``model._no_split_modules`` (the decoder layers), else the
      base model's ``layers.*``; the root is sharded last;
    - ``activation_checkpointing``, ``ac_every``, ``compile``, ``loss_parallel``, ``reshard_after_forward``,
      ``mp_policy``, ``float8``: as in :class:`~modelpar.plans.ParallelPlan` (float8: the LM head, ``lm_head``,
      stays in high precision; docs/float8.md). ``sequence_parallel=True`` raises
      ``NotImplementedError`` (see ``docs/huggingface.md``).

    Head counts (``num_attention_heads``, ``num_key_value_heads``) and every split dimension are checked
    against the tensor-parallel size when the plan is applied, before anything is sharded.
    """
    config = getattr(model, "config", None)
    if not isinstance(model, nn.Module) or config is None:
        raise TypeError(
            f"`plan_for` reads a Hugging Face model's own tensor-parallel plan, but got {type(model).__name__}"
            " with no `config`. Pass a `PreTrainedModel` (e.g. `AutoModelForCausalLM.from_config(config)` on the"
            " meta device), or write a `modelpar.plans.ParallelPlan` for it."
        )
    if sequence_parallel:
        raise NotImplementedError(
            "plan_for(..., sequence_parallel=True) is not supported for Hugging Face models: their base model"
            " derives the positions and the causal mask from the embeddings' sequence length, and their decoder"
            " layers pass the hidden states to attention as a keyword argument, so a sequence-sharded residual"
            " stream would not be gathered before the projections. Use tensor parallelism without sequence"
            " parallelism (the default), with `activation_checkpointing` to save activation memory."
        )
    hf_plan = _hf_tp_plan(model)
    if not hf_plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan: `config.base_model_tp_plan` and the class's"
            " `_tp_plan` are empty. Write a `modelpar.plans.ParallelPlan` for it, e.g."
            " `ParallelPlan(fsdp_units=('model.layers.*',))` for FSDP alone."
        )
    head = _output_embeddings_name(model)
    tied = _tied_head(model)
    modules = dict(model.named_modules())
    parameters = [name for name, _ in model.named_parameters()]
    # A model without experts (or with a dense layer variant) leaves some patterns unmatched: transformers skips
    # those entries too.
    present = {p: s for p, s in hf_plan.items() if any(matches(p, n) for n in (*modules, *parameters) if n)}
    tensor_parallel: dict[str, StyleSpec] = {}
    # A refused entry (a packed projection ...) stays in the plan as a placeholder on its module, which raises only
    # under tensor parallelism: the plan still serves FSDP alone. `moe_tp_experts` goes first: its style (or its
    # refusal) on the experts module covers the module's parameter entries ('packed_colwise', 'rowwise').
    for pattern, hf_style in sorted(present.items(), key=lambda item: item[1] != "moe_tp_experts"):
        on_head = head is not None and pattern == head
        if on_head and tied:
            continue  # sharding the head's weight would untie it from the embeddings: keep it replicated
        module = next((m for n, m in modules.items() if n and matches(pattern, n)), None)
        style: StyleSpec
        try:
            if hf_style in HF_REFUSED:
                raise refused(pattern, hf_style)
            style = translate(pattern, hf_style, module, on_head=on_head, config=config)
        except RefusedStyleError as refusal:  # also a bare parameter split outside its module's style
            style = RefusedStyle(refusal)
        if isinstance(style, RefusedStyle):
            holder = pattern if module is not None else pattern.rpartition(".")[0]
            if holder and holder not in tensor_parallel:
                tensor_parallel[holder] = style
            continue
        if style != SKIP:
            tensor_parallel[pattern] = style
    if loss_parallel and "output" not in tensor_parallel.values():
        why = (
            "its LM head shares its weight with the input embeddings (tied), so the head stays replicated"
            if tied
            else "its tensor-parallel plan does not split the LM head's vocabulary"
        )
        raise ValueError(
            f"plan_for(..., loss_parallel=True): {type(model).__name__} cannot keep its logits vocab-sharded:"
            f" {why}. Turn loss parallelism off{' (or build the model with `tie_word_embeddings=False`)' * tied}."
        )
    return ParallelPlan(
        tensor_parallel=tensor_parallel,
        fsdp_units=_decoder_layers(model),
        experts=_experts_modules(model, modules),
        activation_checkpointing=activation_checkpointing,
        ac_every=ac_every,
        compile=compile,
        loss_parallel=loss_parallel,
        reshard_after_forward=reshard_after_forward,
        mp_policy=mp_policy,
        float8=float8,
    )


def _base_prefix(model: nn.Module) -> str:
    """``"model."`` for a model with a head (``LlamaForCausalLM``), ``""`` for the base model itself."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, None) if prefix else None
    return prefix + "." if isinstance(base, nn.Module) and base is not model else ""


def _hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The config's base-model plan (prefixed) and the class's own plan, in that order."""
    base_plan = getattr(getattr(model, "config", None), "base_model_tp_plan", None) or {}
    prefix = _base_prefix(model)
    plan = {prefix + pattern: style for pattern, style in base_plan.items()}
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


#: The style an experts module has in ``base_model_ep_plan``: ``"ep_dispatch_experts"`` in transformers 5.24, where
#: 5.17 wrote ``"moe_tp_experts"`` (beside ``"ep_router"`` for the router, which modelpar needs no entry for).
_EP_EXPERTS_STYLES = ("ep_dispatch_experts", "moe_tp_experts")


def _experts_modules(model: nn.Module, modules: dict[str, nn.Module]) -> tuple[str, ...]:
    """The experts modules of the config's expert-parallel plan (:data:`_EP_EXPERTS_STYLES` entries) present here.

    transformers names them in ``base_model_ep_plan``; modelpar splits them over the expert axis itself (the
    plan's ``experts``), whatever that plan's other entries say about their parameters.
    """
    ep_plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    prefix = _base_prefix(model)
    patterns = [prefix + pattern for pattern, style in ep_plan.items() if style in _EP_EXPERTS_STYLES]
    return tuple(p for p in patterns if any(name and matches(p, name) for name in modules))


def _output_embeddings_name(model: nn.Module) -> str | None:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Module):
        return None
    return next((name for name, module in model.named_modules() if module is head), None)


def _tied_head(model: nn.Module) -> bool:
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not (callable(get_in) and callable(get_out)):
        return False
    embeddings, head = get_in(), get_out()
    weight_in, weight_out = getattr(embeddings, "weight", None), getattr(head, "weight", None)
    return weight_in is not None and weight_in is weight_out


def _decoder_layers(model: nn.Module) -> tuple[str, ...]:
    """Patterns of the decoder layers: the ``_no_split_modules`` classes, else the base model's ``layers.*``."""
    patterns = {re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name): None for name in unsplit_modules(model)}
    if patterns:
        # A unit nested in another of the same pattern family is fine; FSDP shards the deepest first.
        return tuple(patterns)
    layers = getattr(getattr(model, "base_model", model), "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return (_base_prefix(model) + "layers.*",)
    return ()
