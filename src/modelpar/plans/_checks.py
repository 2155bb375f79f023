"""Pre-flight checks of a :class:`~modelpar.plans.ParallelPlan` against a model, before anything is sharded.

They read only module names, types, shapes and the model's config, so they work on a meta-device model with
no process group, and every rank reaches the same verdict before any collective. Each error names the
submodule, the values and the fix, instead of a shape error deep in a forward pass (or, worse, an uneven
split that runs and computes the wrong thing).
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase

from torch import nn

from modelpar._errors import UnsupportedStyleError
from modelpar.plans._styles import COLUMN_STYLES, STYLES, StyleSpec, sharded_dims
from modelpar.plans._units import ModuleSelector, describe_selector, select

__all__ = [
    "HEAD_COUNT_ATTRIBUTES",
    "check_divisible",
    "check_layers_sharded",
    "WHOLE_MODEL_NAMES",
    "matches",
    "on_other_stage",
    "resolve_styles",
    "resolve_units",
]

#: Config attributes that count attention heads (torchtitan / this package, Hugging Face); TP splits heads.
HEAD_COUNT_ATTRIBUTES = ("n_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")


def matches(pattern: str, name: str) -> bool:
    """``fnmatch`` per dot-separated segment: ``layers.*.attention.wq`` matches ``layers.3.attention.wq`` only.

    A ``*`` never crosses a dot, so ``layers.*`` names the blocks and not everything inside them.
    """
    pattern_parts, name_parts = pattern.split("."), name.split(".")
    return len(pattern_parts) == len(name_parts) and all(map(fnmatchcase, name_parts, pattern_parts))


def _submodules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: module for name, module in model.named_modules() if name}  # the root has no name to match


#: Set on a pipeline stage (``modelpar.pipeline``): the module names of the whole model. A plan applied to a stage
#: skips a pattern that matches only modules of other stages (``tok_embeddings`` on every stage but the first);
#: one that matches nothing in the whole model is still an error.
WHOLE_MODEL_NAMES = "_modelpar_whole_model_names"


def on_other_stage(model: nn.Module, pattern: str) -> bool:
    """Whether ``model`` is a pipeline stage and ``pattern`` names modules of the whole model (on other stages)."""
    names = getattr(model, WHOLE_MODEL_NAMES, None)
    return names is not None and any(matches(pattern, name) for name in names)


def _no_match(field: str, pattern: str, model: nn.Module, names: Iterable[str]) -> ValueError:
    generic = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in names})
    close = difflib.get_close_matches(pattern, generic, n=3, cutoff=0.5)
    hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    shown = ", ".join(repr(n) for n in generic[:8]) + (", ..." if len(generic) > 8 else "")
    return ValueError(
        f"ParallelPlan.{field}: the pattern {pattern!r} matches no submodule of {type(model).__name__}.{hint}"
        f" Patterns match module names segment by segment ('*' stands for one segment); this model has {shown}."
        " Fix the pattern or remove it."
    )


def resolve_styles(
    model: nn.Module, tensor_parallel: Mapping[str, StyleSpec], *, sequence_parallel: bool
) -> dict[str, StyleSpec]:
    """Submodule name -> its style; raise for a pattern matching nothing, two styles, or a style of another kind."""
    modules = _submodules(model)
    styles: dict[str, StyleSpec] = {}
    source: dict[str, str] = {}
    for pattern, style in tensor_parallel.items():
        found = [name for name in modules if matches(pattern, name)]
        if not found and not on_other_stage(model, pattern):
            raise _no_match("tensor_parallel", pattern, model, modules)
        for name in found:
            if name in styles:
                raise ValueError(
                    f"ParallelPlan.tensor_parallel: {name!r} gets two styles, {_show(styles[name])} from"
                    f" {source[name]!r} and {_show(style)} from {pattern!r}. Give each submodule one pattern."
                )
            styles[name], source[name] = style, pattern
    for name, style in styles.items():
        kinds = STYLES.get(style, ()) if isinstance(style, str) else ()
        if kinds and not isinstance(modules[name], kinds):
            raise UnsupportedStyleError(
                f"ParallelPlan.tensor_parallel: style {style!r} shards {' or '.join(f'nn.{k.__name__}' for k in kinds)}"
                f" modules, but {name!r} (from {source[name]!r}) is `{type(modules[name]).__name__}`. Point the pattern"
                " at its parallelizable children, or use 'sequence_gather' / 'norm' for a container or a norm."
            )
    if sequence_parallel:
        gathered = [name for name, style in styles.items() if style == "sequence_gather"]
        for name, style in styles.items():
            if style in COLUMN_STYLES and not any(name.startswith(g + ".") for g in gathered):
                parent = source[name].rpartition(".")[0] or "<the module that calls it>"
                raise ValueError(
                    f"ParallelPlan(sequence_parallel=True): {name!r} (style {style!r}) would receive the"
                    " sequence-sharded residual stream, but no enclosing module gathers it first. Add"
                    f" {{{parent!r}: 'sequence_gather'}} to tensor_parallel (one all-gather for all the projections"
                    " inside), or turn sequence parallelism off."
                )
    return styles


def check_refused(styles: Mapping[str, StyleSpec], tensor_parallel_size: int) -> None:
    """With tensor parallelism, raise the refusal a placeholder style carries (``modelpar.hf``'s ``RefusedStyle``).

    A plan may name a module whose split is known to be impossible (yet) by a style with a ``refusal`` exception:
    the plan still serves FSDP alone, and asking it for tensor parallelism raises that exception first.
    """
    if tensor_parallel_size <= 1:
        return
    for style in styles.values():
        refusal = getattr(style, "refusal", None)
        if isinstance(refusal, Exception):
            raise refusal


def resolve_modules(model: nn.Module, field: str, patterns: Iterable[str], what: str, example: str) -> list[str]:
    """The submodule names a plan field's ``patterns`` select, in pattern order; ``ValueError`` for one matching none.

    For the message: ``field`` the plan's field (``"experts"``), ``what`` the modules it names (``"MoE"``) and
    ``example`` a pattern that would fit (``"layers.*.moe"``).
    """
    names = [name for name, _ in model.named_modules() if name]
    found: list[str] = []
    for pattern in patterns:
        hits = [name for name in names if matches(pattern, name)]
        if not hits and not on_other_stage(model, pattern):
            raise ValueError(f"{_no_match(field, pattern, model, names)} Name the {what} modules (e.g. {example!r}).")
        found.extend(hits)
    return found


def resolve_units(model: nn.Module, fsdp_units: ModuleSelector, field: str = "fsdp_units") -> list[str]:
    """Names of the selected submodules (FSDP units), in the model's module order; raise when a selector picks none.

    ``fsdp_units`` is patterns (each must match), module classes or a predicate (see ``plans._units``).
    """
    modules = _submodules(model)
    if isinstance(fsdp_units, tuple):
        chosen: set[str] = set()
        for pattern in fsdp_units:
            found = {name for name in modules if matches(pattern, name)}
            if not found and not on_other_stage(model, pattern):
                raise _no_match(field, pattern, model, modules)
            chosen |= found
        return [name for name in modules if name in chosen]
    picked = select(model, fsdp_units)
    if not picked:
        raise ValueError(
            f"ParallelPlan.{field}: {describe_selector(fsdp_units)} selects no submodule of {type(model).__name__}."
            f" Its module classes are {sorted({type(m).__name__ for m in modules.values()})[:12]}; name one of"
            " them, or use patterns such as ('layers.*',)."
        )
    return picked


def _head_counts(model: nn.Module) -> list[tuple[str, int]]:
    config = getattr(model, "config", None)
    counts = []
    for attribute in HEAD_COUNT_ATTRIBUTES:
        value = getattr(config, attribute, None)
        if isinstance(value, int) and not isinstance(value, bool):
            counts.append((attribute, value))
    return counts


def check_divisible(model: nn.Module, styles: Mapping[str, StyleSpec], tensor_parallel_size: int) -> None:
    """Every dimension a style splits, and the config's head counts, must divide by the TP size."""
    if tensor_parallel_size <= 1 or not styles:
        return
    modules = _submodules(model)
    sizes: list[int] = []
    bad: dict[tuple[str, str, int], list[str]] = {}  # (what, attribute, size) -> submodules, to group the blocks
    for name, style in styles.items():
        for attribute, size in sharded_dims(modules[name], style):
            sizes.append(size)
            if size % tensor_parallel_size:
                generic = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)
                bad.setdefault((f"{generic!r} {attribute}", f" (style {_show(style)})", size), []).append(name)
    for attribute, size in _head_counts(model):
        sizes.append(size)
        if size % tensor_parallel_size:
            bad.setdefault((f"config.{attribute}", " (heads)", size), [])
    if not bad:
        return
    shown = [f"{what}={size}{why}" for (what, why, size) in bad]
    problems = "; ".join(shown[:4]) + (f"; and {len(shown) - 4} more" if len(shown) > 4 else "")
    common = math.gcd(*sizes)
    valid = [d for d in range(1, common + 1) if common % d == 0]
    fix = (
        f"Choose a tensor_parallel_size that divides them all ({', '.join(map(str, valid))}), or change the model."
        if len(valid) > 1
        else "Only 1 divides them all: turn tensor parallelism off (tensor_parallel_size=1) or change the model."
    )
    raise ValueError(
        f"tensor_parallel_size={tensor_parallel_size} must divide every dimension the plan splits across the"
        f" tensor-parallel ranks, but it does not divide {problems}. {fix}"
    )


#: Style names that split no weight across the tensor-parallel ranks (they only move activations).
_NOT_SHARDING = ("norm", "sequence_gather")


def check_layers_sharded(
    model: nn.Module, styles: Mapping[str, StyleSpec], units: Iterable[str], tensor_parallel_size: int
) -> None:
    """With tensor parallelism on, some FSDP unit (a decoder layer) must have a weight the plan splits.

    Otherwise every layer is replicated on each tensor-parallel rank (FSDP shards only over the data-parallel
    ones), so memory per rank grows with the TP size while the run looks parallel. Such a plan is refused. A
    plan with no FSDP units names no layers, so it is not judged.
    """
    units = list(units)
    if tensor_parallel_size <= 1 or not units:
        return
    sharding = [name for name, style in styles.items() if not (isinstance(style, str) and style in _NOT_SHARDING)]
    if any(name == unit or name.startswith(unit + ".") for name in sharding for unit in units):
        return
    generic = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in units})
    covered = sorted({re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n) for n in sharding})
    what = f"only {', '.join(map(repr, covered))}" if covered else "no submodule"
    config = getattr(model, "config", None)
    base_plan = getattr(config, "base_model_tp_plan", None)
    source = (
        " The model's own Hugging Face tensor-parallel plan, which `modelpar.hf.plan_for` reads, covers no decoder"
        f" layer either (`config.base_model_tp_plan`: {base_plan or {}}, `{type(model).__name__}._tp_plan`:"
        f" {getattr(type(model), '_tp_plan', None) or {}})."
        if config is not None and hasattr(config, "base_model_tp_plan") and not base_plan
        else ""
    )
    raise ValueError(
        f"tensor_parallel_size={tensor_parallel_size}, but the plan for {type(model).__name__} shards {what} across"
        f" the tensor-parallel ranks and no decoder layer ({', '.join(map(repr, generic))}): every layer would be"
        f" replicated on each of the {tensor_parallel_size} ranks, so memory per rank grows with the"
        f" tensor-parallel size instead of shrinking.{source} Use `tensor_parallel_size=1` (FSDP over all ranks),"
        " or write a `modelpar.plans.ParallelPlan` whose `tensor_parallel` splits the layers' projections (e.g."
        " {'model.layers.*.self_attn.q_proj': 'colwise', 'model.layers.*.self_attn.o_proj': 'rowwise', ...})."
    )


def _show(style: StyleSpec) -> str:
    return repr(style) if isinstance(style, str) else type(style).__name__
