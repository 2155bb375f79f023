"""Which submodules a plan acts on, named the three ways users know: name patterns, classes, or a predicate.

A :class:`~modelpar.plans.ParallelPlan` names its FSDP units (and, optionally, the modules it checkpoints) by
patterns (``"layers.*"``), as torchtitan does; FSDP1 users name them by class (``{TransformerBlock}``, what
``ModuleWrapPolicy`` took) or by a function of the module (``lambda m: isinstance(m, Block)``). All three resolve
here, on the model itself, to the same thing: submodule names in module order. The root is never a unit (it is
always sharded last, by the plan). :func:`repeated_blocks` is how the strategy picks units when nobody named any.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

__all__ = [
    "ModuleSelector",
    "RepeatedBlocks",
    "SelectedBy",
    "describe_selector",
    "normalize_selector",
    "outermost",
    "repeated_blocks",
    "select",
    "unsplit_modules",
]


@dataclass(frozen=True)
class SelectedBy:
    """Modules chosen by a function of the whole model, for choices that are not per module: FSDP1's wrap policies
    (``size_based_auto_wrap_policy`` counts what the children took) and the modules a model declares itself."""

    pick: Callable[[nn.Module], list[str]]
    description: str


#: Patterns (a tuple of str), module classes (a set, frozenset, list or tuple of types, or one type), a
#: predicate ``(module) -> bool``, or :class:`SelectedBy`.
ModuleSelector = tuple[str, ...] | frozenset[type[nn.Module]] | Callable[[nn.Module], bool] | SelectedBy


def normalize_selector(value: object, owner: str, field: str) -> ModuleSelector:
    """One canonical, hashable form (patterns as a tuple, classes as a frozenset), or a ``TypeError`` that names
    ``owner(field=value)``."""
    if isinstance(value, type):
        value = (value,)
    shown = f"{owner}({field}={value!r})"
    kinds = (
        "a tuple of non-empty patterns, such as ('layers.*',), a set of `nn.Module` classes, such as"
        " {TransformerBlock}, or a callable `(module) -> bool`"
    )
    if isinstance(value, str):
        raise TypeError(f"{shown} must be {kinds}, not a single str.")
    if isinstance(value, (set, frozenset, list, tuple)):
        items = list(value)
        if items and all(isinstance(item, type) and issubclass(item, nn.Module) for item in items):
            return frozenset(items)
        if all(isinstance(item, str) and item for item in items):
            return tuple(items)
        raise TypeError(f"{shown} must be {kinds}; it holds something else (or a mix of patterns and classes).")
    if isinstance(value, SelectedBy) or callable(value):
        return value
    raise TypeError(f"{shown} must be {kinds}, but got {type(value).__name__}.")


def select(
    model: nn.Module, selector: frozenset[type[nn.Module]] | Callable[[nn.Module], bool] | SelectedBy
) -> list[str]:
    """Names of the submodules a class set, predicate or :class:`SelectedBy` picks, in module order (patterns
    resolve with their checks, ``plans._checks.resolve_units``)."""
    if isinstance(selector, SelectedBy):
        return [name for name in selector.pick(model) if name]
    if isinstance(selector, frozenset):
        classes = tuple(selector)
        return [name for name, module in model.named_modules() if name and isinstance(module, classes)]
    return [name for name, module in model.named_modules() if name and selector(module)]


def describe_selector(selector: ModuleSelector) -> str:
    """How a selector reads in a message: its patterns, its class names, or the predicate's name."""
    if isinstance(selector, tuple):
        return repr(selector)
    if isinstance(selector, frozenset):
        return "{" + ", ".join(sorted(c.__name__ for c in selector)) + "}"
    if isinstance(selector, SelectedBy):
        return selector.description
    return getattr(selector, "__name__", repr(selector))


@dataclass(frozen=True)
class RepeatedBlocks:
    """The blocks :func:`repeated_blocks` found: their class, and their names in module order."""

    cls: type[nn.Module]
    names: tuple[str, ...]


def repeated_blocks(model: nn.Module) -> RepeatedBlocks | None:
    """The model's repeated blocks: the modules of one class that fill its largest ``ModuleList`` / ``Sequential``.

    A decoder's layers (``model.layers``), a ResNet's stages of ``Bottleneck`` blocks: the units FSDP1 users wrapped
    by hand. "Largest" counts parameters, then the number of blocks, so a long list of small modules (dropouts,
    per-layer norms) does not win over the layers. A container whose children are of several classes does not
    count (nothing repeats), nor one of fewer than two children. Every module of the winning class anywhere in
    the model is a block (a class used outside the list is the same kind of unit). None when nothing repeats.
    """
    best: tuple[int, int, type[nn.Module]] | None = None
    for module in model.modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        classes = {type(child) for child in module}
        if len(classes) != 1:
            continue
        (cls,) = classes
        if cls in (nn.ModuleList, nn.Sequential) or not any(True for _ in module.parameters()):
            continue
        score = (sum(p.numel() for p in module.parameters()), len(module), cls)
        if best is None or score[:2] > best[:2]:
            best = score
    if best is None:
        return None
    cls = best[2]
    names = tuple(name for name, module in model.named_modules() if name and type(module) is cls)
    return RepeatedBlocks(cls, names)


def outermost(names: Iterable[str]) -> list[str]:
    """The names not nested in another of ``names`` (activation checkpointing and compile apply to those)."""
    chosen = list(names)
    return [n for n in chosen if not any(n.startswith(other + ".") for other in chosen)]


def unsplit_modules(model: nn.Module) -> list[str]:
    """The modules of the classes ``model`` or any module in it names in ``_no_split_modules``.

    transformers declares there, per model class, the blocks that must stay whole on one device (its decoder
    layers): what accelerate and FSDP1's ``transformer_layer_cls_to_wrap`` shard as units. Read from every module,
    so a Hugging Face model inside a LightningModule counts, and by class name, so without importing transformers.
    """
    classes = {c for m in model.modules() for c in (getattr(m, "_no_split_modules", None) or ())}
    return [name for name, module in model.named_modules() if name and type(module).__name__ in classes]
