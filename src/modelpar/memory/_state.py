"""The model state per rank, parameter by parameter: what tensor parallelism splits, what FSDP2 shards and pads,
which unit gathers it. Shared by the whole-model estimate and the per-stage one under pipeline parallelism, which
counts the same way over the parameters of one stage (each stage is its own FSDP root there).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from modelpar._mesh.layout import MeshLayout
from modelpar._train.fsdp import fsdp_shard_dim
from modelpar.memory._transients import ROOT
from modelpar.plans._styles import StyleSpec

__all__ = ["StateCount", "StateRules", "count_state", "unit_of"]

_COLUMN_NAMES = ("colwise", "colwise_gather", "output")
_ROW_NAMES = ("rowwise", "embedding")
_REPLICATING = (SequenceParallel, PrepareModuleInput, PrepareModuleOutput)
_FLOAT8 = 1  # bytes of a float8 element (torch.float8_e4m3fn)


@dataclass(frozen=True)
class StateRules:
    """What decides a parameter's bytes: the layout, the plan's resolved styles and units, the dtypes."""

    model: nn.Module
    layout: MeshLayout
    styles: dict[str, StyleSpec]
    experts: dict[str, str]  # experts module -> its own FSDP unit (expert parallelism)
    units: list[str]
    policy: MixedPrecisionPolicy
    true_dtype: torch.dtype | None  # "bf16-true" / "16-true": parameters stored in that dtype
    states: int  # parameter-shaped optimizer states per parameter
    float8_weights: frozenset[str] = frozenset()  # parameters FSDP2 all-gathers in float8 (modelpar.memory._float8)


@dataclass
class StateCount:
    """Bytes of some parameters on one rank (sharded, unsharded gradients) and per FSDP unit: gathered, its unsharded
    gradients in the compute dtype (what ``gathered`` is but for weights gathered in float8), the reduce-scatter input,
    and what one all-gather of the unit brings from the other ranks (and would bring without float8)."""

    sharded: int = 0
    optimizer: int = 0
    unsharded_grads: int = 0
    gathered: dict[str, int] = field(default_factory=dict)
    unit_gradients: dict[str, int] = field(default_factory=dict)
    reduce_buffer: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    received_without_float8: dict[str, int] = field(default_factory=dict)
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32


def count_state(rules: StateRules, parameters: Iterable[tuple[str, nn.Parameter]], notes: set[str]) -> StateCount:
    """Add up ``parameters`` (name, tensor; each once) as the plan lays them out on ``rules.layout``.

    The tensor-parallel style of a parameter's module splits a dim, then FSDP shards dim 0 of what is left over the
    shard group in padded chunks (or, for fused experts with fewer rows than ranks, evenly on a later dim), exactly as
    ``fully_shard`` allocates them; the unit that holds the module all-gathers it in the compute dtype, or in float8
    (one byte an element, the padding included) for ``rules.float8_weights``.
    """
    layout, policy, true_dtype = rules.layout, rules.policy, rules.true_dtype
    tp, shard = layout.tensor_parallel_size, layout.fsdp_shard_size
    count = StateCount()
    for name, param in parameters:
        module_name, _, local_name = name.rpartition(".")
        storage = true_dtype if true_dtype is not None and param.is_floating_point() else param.dtype
        compute = policy.param_dtype if policy.param_dtype is not None and param.is_floating_point() else storage
        count.param_dtype, count.compute_dtype = storage, compute
        reduce = policy.reduce_dtype if policy.reduce_dtype is not None else compute
        shape = list(param.shape)
        style = rules.styles.get(module_name)
        if style is not None:
            dim = _tp_dim(rules.model.get_submodule(module_name), local_name, style, notes, module_name)
            if dim is not None:
                shape[dim] //= tp
        rows, rest = (shape[0], math.prod(shape[1:])) if shape else (1, 1)
        unit, group = rules.experts.get(module_name), shard
        if unit is not None:  # E / ep whole experts, FSDP over the ranks holding the same ones, their own unit
            rows, group = rows // layout.expert_parallel_size, layout.expert_shard_size
        # FSDP2's padded dim-0 chunks, or for fused experts fewer than the ranks an even cut of a later dim
        even = fsdp_shard_dim((rows, *shape[1:]), group) > 0
        per_rank = rows * rest // group if even else math.ceil(rows / group) * rest
        count.sharded += per_rank * storage.itemsize
        count.optimizer += rules.states * per_rank * storage.itemsize
        count.unsharded_grads += rows * rest * reduce.itemsize
        unit = unit or unit_of(module_name, rules.units)
        gathered = _FLOAT8 if name in rules.float8_weights else compute.itemsize
        _add(count.gathered, unit, per_rank * group * gathered)
        _add(count.unit_gradients, unit, per_rank * group * compute.itemsize)
        _add(count.reduce_buffer, unit, per_rank * group * reduce.itemsize)
        _add(count.received, unit, per_rank * (group - 1) * gathered)
        _add(count.received_without_float8, unit, per_rank * (group - 1) * compute.itemsize)
    return count


def _add(sizes: dict[str, int], unit: str, size: int) -> None:
    sizes[unit] = sizes.get(unit, 0) + size


def _tp_dim(module: nn.Module, local_name: str, style: StyleSpec, notes: set[str], module_name: str) -> int | None:
    """The dim of ``module.<local_name>`` that ``style`` splits across the tensor-parallel ranks, or ``None``."""
    column = style in _COLUMN_NAMES or isinstance(style, ColwiseParallel)
    row = style in _ROW_NAMES or isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Linear) and (column or row):
        if local_name == "weight":
            return 0 if column else 1
        return 0 if column and local_name == "bias" else None
    if isinstance(module, nn.Embedding) and (column or row) and local_name == "weight":
        return 1 if column else 0
    split = getattr(style, "splits_parameters_dim", None)
    if isinstance(split, int):  # a style that splits each of its module's own parameters along one dim
        return split
    if isinstance(style, (str, *_REPLICATING)) or getattr(style, "replicates_parameters", False):
        return None  # norm, sequence_gather: parameters replicated (or untouched) on the tensor-parallel ranks
    notes.add(
        f"{module_name!r}: {type(style).__name__} on {type(module).__name__} is counted unsplit (the estimate knows"
        " ColwiseParallel, RowwiseParallel and SequenceParallel only)."
    )
    return None


def unit_of(module_name: str, units: list[str]) -> str:
    """The deepest FSDP unit that holds ``module_name`` (``fully_shard`` bottom-up: inner units own theirs)."""
    owners = [u for u in units if module_name == u or module_name.startswith(u + ".")]
    return max(owners, key=len) if owners else ROOT
