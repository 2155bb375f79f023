"""A pipeline stage as a module: the model with only the stage's modules, under the whole model's names.

A stage is a shallow copy of the model (and of each module on the way down to the stage's modules) whose other
modules are ``None``, torchtitan's convention: the model's own ``forward`` skips a module that is ``None``
(``modelpar.models.Llama`` does: no embedding -> the input is hidden states, no output layer -> it returns them).
The blocks' container becomes a :class:`StageLayers` holding this stage's blocks under their original keys
(``layers.3`` stays ``layers.3``), so parameter and state-dict names stay the unsplit model's and checkpoints do
not depend on the pipeline size. The copies share the modules they keep with the model; nothing is allocated.

After set-up the model the user holds is pruned the same way, to every stage this rank holds (one, or several with
a looped schedule): its parameters are this rank's, which is what the optimizer, clipping and checkpoints see.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

__all__ = ["StageLayers", "prune", "stage_view"]


class StageLayers(nn.ModuleDict):
    """Some of a ``ModuleList``'s modules, under their keys in the whole list, iterated in order like the list.

    A stage holds layers 4-7 of 16 as ``layers.4`` ... ``layers.7``: a ``ModuleList`` would renumber them. Iterating
    yields the modules (not the keys, as a ``ModuleDict`` would) and slicing gives a list, so a forward written
    ``for layer in self.layers`` (or ``self.layers[: n]``) runs the stage's layers.
    """

    def __iter__(self) -> Iterator[nn.Module]:  # type: ignore[override]  # its values, not keys
        return iter(self._modules.values())

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, (int, slice)):
            return list(self._modules.values())[key]
        return super().__getitem__(key)


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its tensors and submodules, with its own tables (children, hooks ...)."""
    clone = copy.copy(module)
    for name, value in vars(clone).items():
        if isinstance(value, (dict, set)):
            setattr(clone, name, copy.copy(value))
    return clone


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _cut(module: nn.Module, prefix: str, keep: frozenset[str], *, in_place: bool) -> nn.Module:
    """``module`` with only the submodules named in ``keep`` (and those owning no parameter); others ``None``."""
    target = module if in_place else _shallow(module)
    for name, child in list(module._modules.items()):
        if child is None:
            continue
        full = f"{prefix}.{name}" if prefix else name
        if full in keep or not _has_params(child):
            continue  # kept as it is
        if not any(k.startswith(full + ".") for k in keep):
            target._modules[name] = None
            continue
        if isinstance(child, (nn.ModuleList, StageLayers)):
            kept = {
                key: (sub if f"{full}.{key}" in keep else _cut(sub, f"{full}.{key}", keep, in_place=in_place))
                for key, sub in child._modules.items()
                if sub is not None and (f"{full}.{key}" in keep or any(k.startswith(f"{full}.{key}.") for k in keep))
            }
            target._modules[name] = StageLayers(kept)
        else:
            target._modules[name] = _cut(child, full, keep, in_place=in_place)
    return target


def stage_view(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """A stage: ``model`` shallow-copied down to the modules ``names`` (and modules without parameters)."""
    return _cut(model, "", frozenset(names), in_place=False)


def prune(model: nn.Module, names: Iterable[str]) -> nn.Module:
    """``model`` itself, cut down in place to the modules ``names`` (all of this rank's stages)."""
    return _cut(model, "", frozenset(names), in_place=True)
