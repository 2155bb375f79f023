"""Float8 training in the estimate (``ParallelPlan(float8=...)``, :mod:`modelpar.float8`): the bytes torchao's float8
linear layers change in a step, read from ``torchao/float8`` (0.18: ``float8_linear.py``, ``fsdp_utils.py``,
``float8_scaling_utils.py``) and measured on CPU under emulation (``docs/memory.md``).

Which layers convert is :func:`modelpar.float8.float8_layers`' choice, the one the plan's conversion makes (the same
styles, tensor-parallel size and experts). Notation of :mod:`modelpar.memory._activations`; per converted layer ``T``
tokens, ``I`` / ``O`` its input / output features on one tensor-parallel rank, ``W = I O``.

- **State**: unchanged. The master weights, their gradients and the optimizer states stay in high precision.
- **Gathered weights**: under the float8 all-gather (the tensorwise recipe where FSDP2 shards over more than one
  rank, unless ``all_gather`` says otherwise: ``Float8Training.gathers_in_float8_over``) FSDP2 all-gathers each
  converted weight as float8 (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather``): one byte an element
  (FSDP2's padding included) instead of the compute dtype's, in every gathered unit (the root's from forward through
  backward too) and in what each all-gather moves. The unit's unsharded gradients stay in the compute dtype. Other
  recipes, and tensorwise over one rank, all-gather as before and cast a float8 copy of the weight at each use.
- **Activations, eager**: unchanged. ``matmul_with_hp_or_float8_args`` saves its high-precision input and weight
  (``ctx.save_for_backward(input_hp, weight_hp_t)``), as ``nn.Linear`` does, and casts them again in backward; under
  activation checkpointing the same outputs are kept (the float8 multiply is a matmul for the selective policy).
- **Activations, compiled and not checkpointed** (:func:`modelpar.memory._compiled.float8_saving`): inductor's
  partitioner recomputes the input of a float8 layer (and casts it again) where eager keeps it: per decoder layer
  whose linear layers all train in float8 (routers aside), the attention norm's output (``b s d a``) and, for a dense
  feed-forward, the feed-forward norm's output (``b s d a``) and the SwiGLU product (``b s f a``). Not under
  ``rowwise_with_gw_hp``, whose weight gradient multiplies the high-precision input.
- **Casts in backward** (:func:`backward_casts`): a converted layer's backward casts its output gradient (for the input
  gradient and again for the weight gradient), its weight (unless gathered in float8) and its input to float8, and
  holds them until it returns: ``2 T O + W + T I`` bytes (``rowwise_with_gw_hp``: ``T O + W``, its weight gradient in
  high precision). Eager torch makes each through two fp32 buffers of its size (``tensor.to(float32) * scale``, then
  the saturating clamp: 8 bytes an element), beside the float8 copies made before it; a compiled layer fuses them.
  The worst converted layer of a unit makes a moment of its own (:func:`~modelpar.memory._transients.worst_moment`).
  Forward's casts (input and weight) come and go before backward's peak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from modelpar.float8._convert import float8_layers
from modelpar.float8._spec import Float8Training, float8_spec
from modelpar.memory._activations import ActivationEstimate
from modelpar.memory._state import StateCount, unit_of
from modelpar.plans._checks import resolve_styles
from modelpar.plans._experts import drop_expert_styles, moe_modules
from modelpar.plans._plan import ParallelPlan
from modelpar.plans._styles import StyleSpec, sharded_dims

__all__ = [
    "Float8Choice",
    "Float8Estimate",
    "backward_casts",
    "choose_layers",
    "float8_decoder_layers",
    "float8_report",
    "unit_casts",
    "with_float8",
]

_FP32 = 4
#: Bytes per element an eager cast holds besides its float8 result: the fp32 scaled copy and its clamp.
_EAGER_CAST = 2 * _FP32
#: Recipes whose backward casts the saved input again (for the weight gradient): compiled, it is recomputed.
_RECASTS_INPUT = ("tensorwise", "rowwise")
_ROUTERS = ("gate", "router")


@dataclass(frozen=True)
class Float8Choice:
    """The float8 layers of an estimate: the spec, the converted layers, those kept in high precision (with why), the
    parameters FSDP2 all-gathers in float8, and whether it does (the spec's rule for the layout's shard size)."""

    spec: Float8Training
    layers: tuple[str, ...]
    kept: Mapping[str, str]
    gathered_weights: frozenset[str]
    gathers_in_float8: bool


@dataclass(frozen=True)
class Float8Estimate:
    """What float8 changes in an estimate, for the report (``MemoryEstimate.float8``).

    ``all_gather``: bytes one rank receives to all-gather each of its FSDP units once (FSDP2 gathers a unit in forward
    and again in backward, the root once); ``all_gather_without_float8``: the same with the weights in the compute
    dtype. ``activations_saved``: what compiled float8 layers keep less than compiled high-precision ones (one
    micro-batch per stage under pipeline parallelism). ``casts``: the most float8 cast bytes one layer's backward holds.
    ``largest_unit_in_float8``: whether the largest gathered unit holds weights gathered in float8.
    """

    recipe: str
    converted: int
    kept: tuple[tuple[str, str], ...]
    gathers_in_float8: bool
    emulate: bool
    all_gather: int
    all_gather_without_float8: int
    activations_saved: int
    casts: int
    largest_unit_in_float8: bool = False


def with_float8(plan: ParallelPlan, float8: object) -> ParallelPlan:
    """``plan`` with ``estimate_memory``'s ``float8`` argument in it, as the strategies hand theirs to a plan."""
    spec = float8_spec(float8, "estimate_memory")
    if spec is None:
        return plan
    if plan.float8 is not None and plan.float8 != spec:
        raise ValueError(
            f"`estimate_memory(float8={spec!r})` and its plan's `float8={plan.float8!r}` disagree. Set float8 in one"
            " place: on the plan, or as the argument."
        )
    return plan.replace(float8=spec)


def choose_layers(model: nn.Module, plan: ParallelPlan, tp: int, ep: int, shard: int) -> Float8Choice | None:
    """The plan's float8 layers at this tensor- and expert-parallel size (``None`` without float8), chosen by
    :func:`modelpar.float8.float8_layers` with the styles the plan resolves, as its conversion does; their weights
    gathered in float8 as the conversion decides for FSDP2's ``shard`` size."""
    if plan.float8 is None or isinstance(plan.float8, str):  # a plan makes a recipe name a Float8Training
        return None
    styles = resolve_styles(model, plan.tensor_parallel, sequence_parallel=plan.sequence_parallel)
    if ep > 1:
        styles = drop_expert_styles(styles, moe_modules(model, plan.experts, ep))
    layers, kept = float8_layers(model, plan.float8, styles=styles, tensor_parallel_size=tp, experts=plan.experts)
    gathers = plan.float8.gathers_in_float8_over(shard)
    gathered = frozenset(f"{name}.weight" for name in layers) if gathers else frozenset()
    return Float8Choice(plan.float8, tuple(layers), dict(kept), gathered, gathers)


def float8_decoder_layers(model: nn.Module, choice: Float8Choice) -> frozenset[int]:
    """Indices of the decoder layers whose linear layers (routers aside) all train in float8 and whose recipe casts
    the input again for the weight gradient: those where a compiled layer keeps less
    (:func:`modelpar.memory._compiled.float8_saving`)."""
    if choice.spec.recipe not in _RECASTS_INPUT:
        return frozenset()
    converted = set(choice.layers)
    layers: dict[int, bool] = {}
    for name, module in model.named_modules():
        index = _layer_index(model, name)
        if index is None or not isinstance(module, nn.Linear) or name.rsplit(".", 1)[-1] in _ROUTERS:
            continue
        layers[index] = layers.get(index, True) and name in converted
    return frozenset(index for index, all_float8 in layers.items() if all_float8)


def backward_casts(tokens: int, in_features: int, out_features: int, *, recipe: str, weight: bool, fused: bool) -> int:
    """The most bytes a converted layer's backward holds in float8 casts (and, eager, their fp32 working buffers).

    In torchao's order: the output gradient for the input gradient, the weight (unless ``weight`` is already float8:
    gathered so), then for the weight gradient the output gradient again and the input, each kept until the layer's
    backward returns. ``rowwise_with_gw_hp`` computes the weight gradient in high precision: no second pair.
    """
    grad_output, weight_size = tokens * out_features, 0 if weight else in_features * out_features
    casts = [grad_output, weight_size]
    if recipe != "rowwise_with_gw_hp":
        casts += [grad_output, tokens * in_features]
    held = worst = 0
    for size in casts:
        worst = max(worst, held + size + (0 if fused else _EAGER_CAST * size))
        held += size
    return worst


def unit_casts(
    model: nn.Module,
    choice: Float8Choice,
    *,
    units: list[str],
    styles: Mapping[str, StyleSpec],
    tp: int,
    tokens: int,
    compiled: frozenset[int],
) -> dict[str, int]:
    """Per FSDP unit, the worst :func:`backward_casts` of its converted layers, at their tensor-parallel sizes, each
    compiled (fused casts) when its decoder layer is in ``compiled``."""
    casts: dict[str, int] = {}
    for name in choice.layers:
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear)  # float8_layers chooses linear layers only
        style = styles.get(name)
        split = {attribute for attribute, _ in sharded_dims(module, style)} if style is not None and tp > 1 else set()
        in_features = module.in_features // (tp if "in_features" in split else 1)
        out_features = module.out_features // (tp if "out_features" in split else 1)
        size = backward_casts(
            tokens,
            in_features,
            out_features,
            recipe=choice.spec.recipe,
            weight=f"{name}.weight" in choice.gathered_weights,
            fused=_layer_index(model, name) in compiled,
        )
        unit = unit_of(name, units)
        casts[unit] = max(casts.get(unit, 0), size)
    return casts


def float8_report(
    choice: Float8Choice | None,
    count: StateCount,
    activations: ActivationEstimate | None,
    casts: Mapping[str, int],
    largest_unit: str,
) -> Float8Estimate | None:
    """The :class:`Float8Estimate` of an estimate's figures (``count``: the reported rank's units)."""
    if choice is None:
        return None
    return Float8Estimate(
        recipe=choice.spec.recipe,
        converted=len(choice.layers),
        kept=tuple(choice.kept.items()),
        gathers_in_float8=choice.gathers_in_float8,
        emulate=choice.spec.emulate,
        all_gather=sum(count.received.values()),
        all_gather_without_float8=sum(count.received_without_float8.values()),
        activations_saved=activations.float8_saved if activations is not None else 0,
        casts=max(casts.values(), default=0),
        largest_unit_in_float8=count.gathered.get(largest_unit) != count.unit_gradients.get(largest_unit),
    )


def _layer_index(model: nn.Module, name: str) -> int | None:
    """The decoder layer a module belongs to: the first ``ModuleList`` entry on its path (``layers.3.attention.wq``)."""
    parts = name.split(".")
    for i, part in enumerate(parts[1:], start=1):
        if part.isdigit() and isinstance(model.get_submodule(".".join(parts[:i])), nn.ModuleList):
            return int(part)
    return None
