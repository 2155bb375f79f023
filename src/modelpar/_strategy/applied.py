"""What ``parallelize_fn`` must have done for the layout the strategy was asked for, checked after it runs.

Context and expert parallelism change the mesh whatever ``parallelize_fn`` does; a function that ignores them
would train without an error and learn the wrong thing (attention within a sequence shard) or keep every expert
on every rank. Both checks read only the module, so every rank raises the same ``ValueError``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn
from torch.distributed.tensor import DTensor

from modelpar._mesh.layout import EXPERT_PARALLEL_AXIS

if TYPE_CHECKING:
    from modelpar._mesh.layout import MeshLayout

__all__ = ["check_context_parallel_applied", "check_expert_parallel_applied", "parallelized"]


def parallelized(parallelize_fn: Any, result: object) -> nn.Module:
    """What ``parallelize_fn`` returned, checked to be the module (a forgotten ``return model`` gives ``None``)."""
    if not isinstance(result, nn.Module):
        name = getattr(parallelize_fn, "__name__", type(parallelize_fn).__name__)
        raise TypeError(
            f"The `parallelize_fn` ({name}) must return a `nn.Module` instance, the parallelized model, but it"
            f" returned {type(result).__name__}. End it with `return model`."
        )
    return result


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
