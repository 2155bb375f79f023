"""What ``parallelize_fn`` must have done for the layout the strategy was asked for, checked after it runs.

HSDP, context and expert parallelism change the mesh whatever ``parallelize_fn`` does; a function that ignores
them would train without an error and learn the wrong thing (plain FSDP where replicas were asked for, gradients
never averaged over the context-parallel ranks, attention within a sequence shard) or keep every expert on every
rank. The checks read only the module, so every rank raises the same ``ValueError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from modelpar._mesh.layout import (
    CONTEXT_PARALLEL_AXIS,
    EXPERT_PARALLEL_AXIS,
    HSDP_MESH_AXES,
    MESH_AXES,
    SHARD_CONTEXT_AXIS,
    TOKEN_AXIS,
)

if TYPE_CHECKING:
    from modelpar._mesh.layout import MeshLayout

__all__ = [
    "check_context_parallel_applied",
    "check_expert_parallel_applied",
    "check_fsdp_mesh_applied",
    "parallelized",
]


def parallelized(parallelize_fn: Any, result: object) -> nn.Module:
    """What ``parallelize_fn`` returned, checked to be the module (a forgotten ``return model`` gives ``None``)."""
    if not isinstance(result, nn.Module):
        name = getattr(parallelize_fn, "__name__", type(parallelize_fn).__name__)
        raise TypeError(
            f"The `parallelize_fn` ({name}) must return a `nn.Module` instance, the parallelized model, but it"
            f" returned {type(result).__name__}. End it with `return model`."
        )
    return result


def check_fsdp_mesh_applied(module: nn.Module, layout: MeshLayout) -> None:
    """FSDP must shard over the layout's data-parallel mesh: the 2-D (replicate, shard) one under HSDP, and one that
    includes the context-parallel ranks under context parallelism (``modelpar.fsdp_kwargs`` passes it)."""
    if layout.hsdp:
        flat = sorted({n for n, p in module.named_parameters() if _fsdp_on_flattened_axis(p)})
        if flat:
            shown = ", ".join(flat[:5]) + (" ..." if len(flat) > 5 else "")
            raise ValueError(
                f"HSDP was asked for (`data_parallel_replicate_size={layout.data_parallel_replicate_size}`), but"
                f" {len(flat)} parameter(s) were sharded with `fully_shard(..., mesh=device_mesh['data_parallel'])`"
                f", which is plain FSDP over all {layout.data_parallel_size} data-parallel ranks: {shown}. Call"
                " `fully_shard(module, **modelpar.fsdp_kwargs(device_mesh))` (or"
                " `mesh=modelpar.fsdp_mesh(device_mesh)`), which passes the 2-D (replicate, shard) mesh."
            )
    if layout.context_parallel_size > 1:
        missed = sorted({n for n, p in module.named_parameters() if _fsdp_without_context_axis(p)})
        if missed:
            shown = ", ".join(missed[:5]) + (" ..." if len(missed) > 5 else "")
            raise ValueError(
                f"Context parallelism was asked for (`context_parallel_size={layout.context_parallel_size}`), but"
                f" {len(missed)} parameter(s) were sharded by FSDP over the data-parallel ranks only: {shown}. The"
                " context-parallel ranks see different tokens of the same samples, so their gradients would"
                " never be averaged. Call `fully_shard(module, **modelpar.fsdp_kwargs(device_mesh))` (or"
                " `mesh=modelpar.fsdp_mesh(device_mesh)`), which shards over data x context parallel."
            )


def _fsdp_on_flattened_axis(param: torch.Tensor) -> bool:
    """A parameter FSDP sharded over the flattened ``"data_parallel"`` axis of an HSDP mesh (plain FSDP, not HSDP)."""
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    return bool({MESH_AXES[0], TOKEN_AXIS} & set(names)) and HSDP_MESH_AXES[0] not in names


def _fsdp_without_context_axis(param: torch.Tensor) -> bool:
    """A parameter FSDP sharded on a data-parallel axis that leaves out the context-parallel ranks."""
    names = param.device_mesh.mesh_dim_names or () if isinstance(param, DTensor) else ()
    data_axes = {MESH_AXES[0], *HSDP_MESH_AXES[:2]}
    return bool(data_axes & set(names)) and not ({TOKEN_AXIS, SHARD_CONTEXT_AXIS, CONTEXT_PARALLEL_AXIS} & set(names))


def check_context_parallel_applied(module: nn.Module, layout: MeshLayout) -> None:
    """Under context parallelism, some attention must run across the sequence shards, or results are wrong.

    Each rank holds a shard of every sequence; an attention left as it was would attend within the shard
    only, train without an error and learn the wrong thing. A ``modelpar.plans`` plan swaps the kernel in;
    a hand-written ``parallelize_fn`` must do it too (``modelpar.context.ContextParallelAttention``).
    """
    if layout.context_parallel_size == 1:
        return
    from modelpar.context import ContextParallelAttention

    if not any(isinstance(v, ContextParallelAttention) for m in module.modules() for v in vars(m).values()):
        raise ValueError(
            f"Context parallelism was asked for (`context_parallel_size={layout.context_parallel_size}`), but no"
            " attention of the model runs across the sequence shards after `parallelize_fn`: each rank would"
            " attend within its own shard only. Use a `modelpar.plans` plan (LLAMA_PLAN, `modelpar.hf.plan_for`),"
            " which replaces the kernel, or in your `parallelize_fn` set each attention module's kernel to"
            " `modelpar.context.ContextParallelAttention(device_mesh)` (Hugging Face models:"
            " `modelpar.context.use_context_parallel_attention(model, device_mesh)`)."
        )


def check_expert_parallel_applied(module: nn.Module, layout: MeshLayout) -> None:
    """Under expert parallelism, some expert weights must be split over the expert axis.

    Otherwise every rank of the expert axis keeps all experts (the layout's memory saving is gone) while the
    strategy's mesh and any estimate say they are split; a plan names its MoE modules (``experts=``), a
    hand-written ``parallelize_fn`` calls ``modelpar.moe.parallelize_experts``.
    """
    if layout.expert_parallel_size == 1:
        return
    if not any(
        isinstance(p, DTensor) and EXPERT_PARALLEL_AXIS in (p.device_mesh.mesh_dim_names or ())
        for p in module.parameters()
    ):
        raise ValueError(
            f"Expert parallelism was asked for (`expert_parallel_size={layout.expert_parallel_size}`), but no"
            " parameter of the model is split over the expert axis after `parallelize_fn`: every rank would keep"
            " every expert. Use a plan that names the MoE modules (`modelpar.plans.LLAMA_MOE_PLAN`,"
            " `modelpar.hf.plan_for(model)`, `ParallelPlan(experts=('layers.*.moe',), ...)`), or call"
            " `modelpar.moe.parallelize_experts(moe_module, device_mesh)` in your `parallelize_fn` before"
            " `fully_shard`; or set `expert_parallel_size=1`."
        )
