"""Loading full (unsharded) state into sharded models and optimizers, one tensor at a time.

With the full state memory-mapped, each rank works out from its target's placements which block of each
tensor it owns, cuts that block out of the mapped tensor on the CPU (a view: nothing is read yet), and
copies only that block to the target's device. No communication (every rank has the file), and nothing
larger than a rank's own shard crosses to the device: ``distribute_tensor`` would first copy the whole
tensor there on every rank (an fp32 128k x 16k embedding is 8.4 GB). The extra memory per rank stays near
the largest tensor, not the model size, and no rank ever holds or broadcasts the whole model. Keys and
shapes are checked first, identically on every rank, so a mismatch raises everywhere before anything is
modified.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer

from modelpar._errors import CheckpointKeyError, CheckpointShapeError
from modelpar._init.blocks import local_block as _local_block
from modelpar._init.blocks import shard_block
from modelpar.checkpoint._names import clean_name, named_parameters_clean
from modelpar.checkpoint._pipeline import expected_elsewhere
from modelpar.checkpoint._rekey import optimizer_state_to_names

__all__ = ["check_shapes", "load_full_model_state", "load_full_optimizer_state", "shard_block"]


def _local_slice(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``full``, laid out like ``like`` (a DTensor) or whole (a plain tensor).

    For a DTensor the part is a view of ``full`` (on its device: the CPU for a memory-mapped file), so only
    what the caller copies out of it is read and moved. Placements :func:`_local_block` does not cut fall
    back to ``distribute_tensor``, which moves the whole tensor to the mesh's device first.
    """
    if not isinstance(like, DTensor):
        return full
    mesh = like.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return full.new_empty(like.to_local().shape)
    sizes = [mesh.size(axis) for axis in range(mesh.ndim)]
    block = _local_block(full.shape, coordinate, sizes, like.placements)
    if block is None:
        local = distribute_tensor(full, mesh, like.placements, src_data_rank=None).to_local()
    else:
        local = full
        for dim, (start, length) in enumerate(block):
            local = local.narrow(dim, start, length)
    expected = like.to_local().shape
    if local.shape != expected:  # copy_ would broadcast a wrong block silently; never expected to happen
        raise NotImplementedError(
            f"Cannot cut a shard of shape {tuple(expected)} with placements {like.placements} out of a full tensor"
            f" of shape {tuple(full.shape)}: the cut gives {tuple(local.shape)}. Load a distributed checkpoint"
            " instead (`modelpar convert <file> <folder>`), and report the layout to modelpar."
        )
    return local


def _owned_shard(value: Any, param: torch.Tensor) -> Any:
    """A moment tensor cut to ``param``'s shard and copied out of the (memory-mapped) source; scalars as is."""
    if not isinstance(value, torch.Tensor):
        return value
    if isinstance(param, DTensor) and value.shape == param.shape:
        source = _local_slice(value, param)
        local = torch.empty(source.shape, dtype=value.dtype, device=param.device).copy_(source)
        return DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value.clone()


def check_shapes(expected: Mapping[str, Any], saved_shapes: Mapping[str, Any], where: str) -> None:
    """Raise :class:`CheckpointShapeError` naming the first entry whose saved shape differs from the model's."""
    for name, tensor in expected.items():
        saved = saved_shapes.get(name)
        if saved is not None and tuple(saved) != tuple(tensor.shape):
            raise CheckpointShapeError(
                f"Shape mismatch for {name!r} in {where}: the checkpoint has {tuple(saved)}, the model expects"
                f" {tuple(tensor.shape)}. Load it into a model built with the same configuration."
            )


def load_full_model_state(module: nn.Module, full_state: Mapping[str, Any], *, strict: bool, where: str) -> None:
    """Copy ``full_state`` (e.g. a memory-mapped full state dict) into ``module``'s shards, tensor by tensor."""
    # Sharded DTensors / tensors sharing storage with the module, by stable name (no wrapper segments).
    targets = {clean_name(k): v for k, v in module.state_dict().items()}
    # A pipeline stage checks the whole model's keys, as every other stage does: the same verdict on every rank.
    elsewhere = expected_elsewhere(module)
    missing = [k for k in targets if k not in full_state]
    missing += [k for k in sorted(elsewhere) if k not in targets and k not in full_state]
    unexpected = [k for k in full_state if k not in targets and k not in elsewhere]
    if strict and (missing or unexpected):
        first = (
            f"The model contains a key {missing[0]!r} that does not exist in {where}"
            if missing
            else f"The state in {where} contains a key {unexpected[0]!r} that the model does not have"
        )
        raise CheckpointKeyError(
            f"{first}: the state does not match the model, {len(missing)} missing (e.g. {missing[:3]}),"
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
    elsewhere = expected_elsewhere(module)
    unknown = [k for k in full_osd.get("state", {}) if k not in params and k not in elsewhere]
    if unknown and strict:
        raise CheckpointKeyError(
            f"The optimizer state in {where} has entries for parameters the model does not have: {unknown[:3]}."
            " Pass `strict=False` to skip them."
        )
    sharded: dict[str, Any] = {}
    for name, entries in full_osd.get("state", {}).items():
        if name not in params:
            continue
        param = params[name]
        sharded[name] = {key: _owned_shard(value, param) for key, value in entries.items()}
    groups = full_osd["param_groups"]
    if elsewhere:  # a pipeline stage's optimizer holds its own parameters only
        groups = [dict(g, params=[n for n in g["params"] if n in params]) for g in groups]
    osd = {"state": sharded, "param_groups": groups}
    set_optimizer_state_dict(module, optimizer, osd, options=StateDictOptions(strict=strict))
