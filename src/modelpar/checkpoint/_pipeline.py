"""Full checkpoints of a pipelined model: every stage's tensors gathered into rank 0's one file, and back.

A full save gathers each DTensor to global rank 0 (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``), but under pipeline parallelism rank 0 holds only its stages: torch would gather the other
stages' tensors to nobody. So each stage gathers its own tensors to its leader (the rank at coordinate 0 on every
axis but the pipeline one), tensor by tensor into CPU memory, and the leaders send them to rank 0, which writes the
same file one process would (the unsplit names, every parameter once). "Leader" is per tensor: the rank at
coordinate 0 of the tensor's own mesh (its tensor-parallel peers hold the same whole tensor and send it too; rank 0
keeps one copy). Optimizer states merge the same way: the
states by parameter name, each parameter group's names in stage order.

Loading needs no communication (each rank cuts its shards from the memory-mapped file), only the knowledge that
the other stages' entries are expected: :func:`expected_elsewhere`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

__all__ = ["expected_elsewhere", "full_pipelined_model_state", "full_pipelined_optimizer_state", "is_pipelined"]

_SHARDED = StateDictOptions(full_state_dict=False)


def _pipeline(module: nn.Module) -> Any:
    from modelpar.pipeline._run import pipelined

    return pipelined(module)


def is_pipelined(module: nn.Module) -> bool:
    return _pipeline(module) is not None


def expected_elsewhere(module: nn.Module) -> frozenset[str]:
    """The state-dict keys of the other pipeline stages (empty without pipeline)."""
    pipeline = _pipeline(module)
    return pipeline.whole_state_keys if pipeline is not None else frozenset()


def _full(value: Any) -> Any:
    """A whole CPU copy of ``value`` where this rank is at coordinate 0 of the tensor's mesh (each DTensor gathered
    over its mesh, a collective every rank of the stage joins), None elsewhere; plain tensors are copied as they are
    (identical on the ranks of a stage; rank 0 keeps one)."""
    if isinstance(value, DTensor):
        whole = value.full_tensor()
        coordinate = list(value.device_mesh.get_coordinate() or ())
        return whole.cpu() if all(c == 0 for c in coordinate) else None
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def _kept(entries: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in entries.items() if v is not None}


def _to_rank0(part: dict[str, Any]) -> list[dict[str, Any]]:
    gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else []
    dist.gather_object(part, gathered if dist.get_rank() == 0 else None, dst=0)
    return [g for g in gathered if g]


def full_pipelined_model_state(module: nn.Module) -> dict[str, Any]:
    """The whole model's full state dict on rank 0 (every stage's), ``{}`` elsewhere; all ranks must call it."""
    sharded = get_model_state_dict(module, options=_SHARDED)
    part = _kept({name: _full(value) for name, value in sharded.items()})
    merged: dict[str, Any] = {}
    for stage in _to_rank0(part):
        merged.update(stage)
    return merged


def full_pipelined_optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's full state over every stage on rank 0, keyed by parameter name, ``{}`` elsewhere."""
    sharded: dict[str, Any] = dict(get_optimizer_state_dict(module, optimizer, options=_SHARDED))
    state = {name: _kept(_full(entries)) for name, entries in sharded["state"].items()}
    part = {"state": {k: v for k, v in state.items() if v}, "param_groups": sharded["param_groups"]}
    parts = _to_rank0(part)
    if not parts:
        return {}
    merged: dict[str, Any] = {"state": {}, "param_groups": [dict(g, params=[]) for g in parts[0]["param_groups"]]}
    for stage in parts:
        for name, entries in stage["state"].items():
            merged["state"].setdefault(name, {}).update(entries)
        for group, theirs in zip(merged["param_groups"], stage["param_groups"], strict=True):
            group["params"].extend(n for n in theirs["params"] if n not in group["params"])
    return merged
