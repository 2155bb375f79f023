"""Splitting a user's checkpoint ``state`` into models, optimizers and metadata, and putting it back.

``fabric.save(path, {"model": m, "optimizer": o, "scheduler": s, "step": 3})``: models and optimizers
are sharded tensors handled by the format; everything else is metadata. Objects with
``state_dict()``/``load_state_dict()`` are saved through them and restored **in place** on load, so a
scheduler the user holds a reference to really gets its state back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.optim import Optimizer

from modelpar._errors import CheckpointKeyError

__all__ = ["SplitState", "apply_filter", "metadata_of", "restore_metadata", "split_state", "state_dict_options"]

FilterFns = Mapping[str, Callable[[str, Any], bool]]


@dataclass
class SplitState:
    modules: dict[str, nn.Module] = field(default_factory=dict)
    optimizers: dict[str, tuple[Optimizer, nn.Module]] = field(default_factory=dict)
    other: dict[str, Any] = field(default_factory=dict)


def state_dict_options(*, full: bool) -> StateDictOptions:
    """How the model and optimizer state dicts are taken for a save in the full or the distributed format.

    Full: gathered to rank 0's CPU memory (``cpu_offload``), tensor by tensor, so no device holds the full
    model. Distributed: the shards as they are, on their device, never offloaded first: DCP copies each to
    the CPU as it writes it, and an asynchronous save's stager copies them once, into its kept buffers
    (offloading first would copy every shard twice and hold both copies).
    """
    return StateDictOptions(full_state_dict=full, cpu_offload=full)


def _is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _owner(optimizer: Optimizer, modules: Sequence[nn.Module], key: str) -> nn.Module:
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules:
        if any(id(p) in params for p in module.parameters()):
            return module
    raise ValueError(
        f"The optimizer under key {key!r} holds none of the parameters of the {len(modules)} known model(s)."
        " Put the model it optimizes in the same state dict (or set it up through the strategy), and create"
        " the optimizer from the model's parameters after `setup_module`."
    )


def split_state(state: Mapping[str, Any], known_modules: Sequence[nn.Module] = ()) -> SplitState:
    """Sort ``state`` into models, optimizers (each paired with the model it optimizes) and the rest.

    An optimizer's model is looked for among the models in ``state``, then among ``known_modules``.
    """
    split = SplitState()
    for key, obj in state.items():
        if isinstance(obj, nn.Module):
            split.modules[key] = obj
        elif not isinstance(obj, Optimizer):
            split.other[key] = obj
    for key, obj in state.items():
        if isinstance(obj, Optimizer):
            candidates = [*split.modules.values(), *known_modules]
            split.optimizers[key] = (obj, _owner(obj, candidates, key))
    return split


def metadata_of(other: Mapping[str, Any]) -> dict[str, Any]:
    """Plain values for the metadata file: stateful objects through ``state_dict()``."""
    return {k: (v.state_dict() if _is_stateful(v) else v) for k, v in other.items()}


def apply_filter(key: str, filters: FilterFns | None, values: Any) -> Any:
    """Keep only the entries of ``values`` (a dict) that ``filters[key]`` accepts; unfiltered keys pass whole."""
    if not filters or key not in filters or not isinstance(values, dict):
        return values
    keep = filters[key]
    return {k: v for k, v in values.items() if keep(k, v)}


def restore_metadata(
    requested: dict[str, Any], state: dict[str, Any], saved: dict[str, Any], strict: bool, path: str
) -> dict[str, Any]:
    """Put saved metadata into ``state`` (stateful objects in place) and return what was not requested."""
    missing = [k for k in requested if k not in saved]
    if strict and missing:
        raise CheckpointKeyError(
            f"The requested state contains a key {missing[0]!r} that does not exist in the checkpoint {path!r} (it"
            f" has: {', '.join(repr(k) for k in saved) or 'nothing'}). Pass `strict=False` to skip missing keys."
        )
    remainder = dict(saved)
    for key, target in requested.items():
        if key not in saved:
            continue
        value = remainder.pop(key)
        if _is_stateful(target):
            target.load_state_dict(value)
        else:
            state[key] = value
    return remainder
