"""Loading full (unsharded) state into sharded models and optimizers, one tensor at a time.

With the full state memory-mapped, each rank reads a tensor, cuts out its own shard locally with
``distribute_tensor(..., src_data_rank=None)`` (no communication: every rank has the file), copies it into
place and drops it. The extra memory per rank stays near the largest tensor, not the model size, and no
rank ever holds or broadcasts the whole model. Keys and shapes are checked first, identically on every
rank, so a mismatch raises everywhere before anything is modified.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from modelpar.checkpoint._names import clean_name, named_parameters_clean
from modelpar.checkpoint._rekey import optimizer_state_to_names

__all__ = ["check_shapes", "load_full_model_state", "load_full_optimizer_state"]


def _local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, laid out like ``like`` (a DTensor) or whole (a plain tensor)."""
    if isinstance(like, DTensor):
        return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()
    return full


def _owned_shard(value: Any, param: torch.Tensor) -> Any:
    """A moment tensor cut to ``param``'s shard and copied out of the (memory-mapped) source; scalars as is."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(param, DTensor) and value.shape == param.shape:
        local = _local_slice(value, param).to(param.device).clone()
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value.clone()


def check_shapes(expected: Mapping[str, Any], saved_shapes: Mapping[str, Any], where: str) -> None:
    """Raise ``ValueError`` naming the first entry whose saved shape differs from the model's (global) shape."""
    for name, tensor in expected.items():
        saved = saved_shapes.get(name)
        if saved is not None and tuple(saved) != tuple(tensor.shape):
            raise ValueError(
                f"Shape mismatch for {name!r} in {where}: the checkpoint has {tuple(saved)}, the model expects"
                f" {tuple(tensor.shape)}. Load it into a model built with the same configuration."
            )


def load_full_model_state(module: nn.Module, full_state: Mapping[str, Any], *, strict: bool, where: str) -> None:
    """Copy ``full_state`` (e.g. a memory-mapped full state dict) into ``module``'s shards, tensor by tensor."""
    # Sharded DTensors / tensors sharing storage with the module, by stable name (no wrapper segments).
    targets = {clean_name(k): v for k, v in module.state_dict().items()}
    missing = [k for k in targets if k not in full_state]
    unexpected = [k for k in full_state if k not in targets]
    if strict and (missing or unexpected):
        raise KeyError(
            f"The state in {where} does not match the model: {len(missing)} missing (e.g. {missing[:3]}),"
            f" {len(unexpected)} unexpected (e.g. {unexpected[:3]}). Pass `strict=False` to load the matching"
            " entries only."
        )
    check_shapes(targets, {k: v.shape for k, v in full_state.items() if isinstance(v, torch.Tensor)}, where)
    with torch.no_grad():
        for name, target in targets.items():
            if name not in full_state:
                continue
            local_target = target.to_local() if isinstance(target, DTensor) else target
            local_target.copy_(_local_slice(full_state[name], target))


def load_full_optimizer_state(
    module: nn.Module, optimizer: Optimizer, full_osd: dict[str, Any], *, strict: bool, where: str
) -> None:
    """Load a full optimizer state (keyed by parameter name or by position) into a sharded optimizer.

    Each full moment tensor is cut to its parameter's shard as it is read, so the optimizer never holds
    more than its own shards.
    """
    full_osd = optimizer_state_to_names(full_osd, module, optimizer)
    params = named_parameters_clean(module)
    unknown = [k for k in full_osd.get("state", {}) if k not in params]
    if unknown and strict:
        raise KeyError(
            f"The optimizer state in {where} has entries for parameters the model does not have: {unknown[:3]}."
            " Pass `strict=False` to skip them."
        )
    sharded: dict[str, Any] = {}
    for name, entries in full_osd.get("state", {}).items():
        if name not in params:
            continue
        param = params[name]
        sharded[name] = {key: _owned_shard(value, param) for key, value in entries.items()}
    osd = {"state": sharded, "param_groups": full_osd["param_groups"]}
    set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(strict=strict))
