"""The plan the strategy applies when the user gives none: FSDP2 with units chosen for them.

``ModelParallelStrategy()`` with no ``parallelize_fn`` is the one-line switch from Lightning's ``FSDPStrategy``
(and from accelerate, which picks its units the same way): FSDP1 users never named their units module by module,
they gave classes or let the library find the blocks. So the units are, in order of who said so: the
``fsdp_units`` option (classes, patterns, a predicate, or an FSDP1 ``auto_wrap_policy``); a Hugging Face
model's own ``_no_split_modules`` (its decoder layers, as :func:`modelpar.hf.plan_for` names them); the model's
repeated blocks (:func:`modelpar.plans._units.repeated_blocks`); else the root alone, with a warning. Tensor
parallelism is never guessed: it takes a Hugging Face model's own plan, or is refused.
"""

from __future__ import annotations

from collections import Counter

from torch import nn

from modelpar._rank_zero import rank_zero_info, rank_zero_warn
from modelpar.float8._spec import Float8Training
from modelpar.plans import ParallelPlan
from modelpar.plans._checks import resolve_units
from modelpar.plans._context import is_hugging_face
from modelpar.plans._units import ModuleSelector, SelectedBy, describe_selector, repeated_blocks, unsplit_modules

__all__ = ["default_plan"]


def default_plan(
    model: nn.Module,
    *,
    fsdp_units: ModuleSelector | None,
    activation_checkpointing: object,
    tensor_parallel_size: int,
    expert_parallel_size: int,
    strategy_name: str,
    float8: Float8Training | None = None,
) -> ParallelPlan:
    """The plan for ``model``: FSDP2 over the strategy's data-parallel ranks (HSDP, CP and EP axes included).

    Reads only names, types and shapes, so every rank reaches the same plan (and the same error) before any
    collective. Logs the units on rank 0 in one line; warns when there are none but the root.
    """
    name = type(model).__name__
    hf = is_hugging_face(model)
    if (tensor_parallel_size > 1 or expert_parallel_size > 1) and not hf:
        axis = (
            f"`tensor_parallel_size={tensor_parallel_size}`"
            if tensor_parallel_size > 1
            else f"`expert_parallel_size={expert_parallel_size}`"
        )
        hint = _ready_plan_hint(model)
        raise ValueError(
            f"{axis} needs a plan: `{strategy_name}` without a `parallelize_fn` shards {name} with FSDP2 by itself,"
            f" but how to split its layers across ranks is the model's to say (only Hugging Face models declare it)."
            f" Pass a `modelpar.plans.ParallelPlan`{hint} or a `parallelize_fn`, or set"
            f" {axis.split('=')[0]}=1`."
        )
    if fsdp_units is not None:
        described = describe_selector(fsdp_units)  # an FSDP1 policy says which argument it came from
        units = resolve_units(model, fsdp_units)
        how = described if isinstance(fsdp_units, SelectedBy) else f"fsdp_units={described}"
    else:
        units, how = unsplit_modules(model), "its `_no_split_modules`"
        blocks = repeated_blocks(model) if not units else None
        if blocks is not None:
            units, how = list(blocks.names), "its repeated blocks"
    if activation_checkpointing in ("full", "selective") and not units:
        raise ValueError(
            f"`activation_checkpointing={activation_checkpointing!r}` recomputes the FSDP units, but {name} has no"
            " repeated blocks to make units of. Name the units with `fsdp_units={Block}` (or patterns), or name the"
            " modules to checkpoint: `activation_checkpointing={Block}`."
        )
    checkpointing = activation_checkpointing if activation_checkpointing is not None else "none"
    plan = ParallelPlan(
        fsdp_units=tuple(units),
        activation_checkpointing=checkpointing,  # type: ignore[arg-type]
        float8=float8,
    )
    if hf and (tensor_parallel_size > 1 or expert_parallel_size > 1):
        from modelpar.hf import plan_for  # the hf extra: only a Hugging Face model gets here

        plan = plan_for(model).replace(
            fsdp_units=plan.fsdp_units, activation_checkpointing=checkpointing, float8=float8
        )
    _report(model, units, how, strategy_name, named=fsdp_units is not None)
    return plan


def _report(model: nn.Module, units: list[str], how: str, strategy_name: str, *, named: bool) -> None:
    name = type(model).__name__
    if not units and named:  # `fsdp_units=()`: the root alone, as asked
        rank_zero_info(f"{strategy_name}: FSDP2 shards {name} as one unit ({how}).")
        return
    if not units:
        total = sum(p.numel() for p in model.parameters())
        rank_zero_warn(
            f"`{strategy_name}` found no repeated blocks in {name} (no `nn.ModuleList` or `nn.Sequential` of one"
            f" class), so it shards the whole model as one FSDP unit: every forward and backward all-gathers all"
            f" {total:,} parameters at once, so the peak holds the whole model unsharded. Name the units with"
            " `fsdp_units={Block}` (classes, patterns or a predicate) to gather one block at a time."
        )
        return
    modules = dict(model.named_modules())
    counts = Counter(type(modules[unit]).__name__ for unit in units)
    shown = ", ".join(f"{count} x {cls}" for cls, count in counts.most_common())
    rank_zero_info(f"{strategy_name}: FSDP2 units of {name} ({how}): {shown}, then the root.")


def _ready_plan_hint(model: nn.Module) -> str:
    from modelpar.models import Llama  # the reference model has ready-made plans

    if isinstance(model, Llama):
        moe = getattr(getattr(model, "config", None), "n_experts", 0)
        return f" (`modelpar.plans.{'LLAMA_MOE_PLAN' if moe else 'LLAMA_PLAN'}` for {type(model).__name__})"
    return ""
