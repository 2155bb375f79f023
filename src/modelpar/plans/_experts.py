"""Mixture-of-experts in a plan: find the MoE modules, check them against the expert axis, put them on the mesh.

The plan's ``experts`` patterns name the MoE modules (``"layers.*.moe"``). Under ``expert_parallel_size > 1`` each
one's experts are split over the expert axis and FSDP-sharded over the ranks holding the same experts, and tokens
reach them by all-to-all (``modelpar.moe.parallelize_experts``); with one expert rank but several token ranks only
the router statistics are summed, so the auxiliary losses are the global batch's. The checks read names, attributes
and shapes only, so every rank raises the same error before any collective.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from modelpar.plans._checks import resolve_modules

__all__ = ["apply_experts", "moe_modules"]


def moe_modules(model: nn.Module, patterns: tuple[str, ...], expert_parallel_size: int) -> list[str]:
    """The names of the MoE modules ``patterns`` select, each checked against ``expert_parallel_size``.

    Raises ``ValueError`` when expert parallelism is on and the plan names no MoE module, when a pattern matches
    nothing, or when a module's experts do not split evenly (``modelpar.moe.check_moe_module``).
    """
    from modelpar.moe import check_moe_module

    if expert_parallel_size > 1 and not patterns:
        raise ValueError(
            f"Expert parallelism (`expert_parallel_size={expert_parallel_size}`) splits the experts of every MoE"
            f" module of {type(model).__name__}, but the plan names none. Pass `ParallelPlan(experts=('layers.*.moe',),"
            " ...)` with the MoE modules (as `modelpar.plans.LLAMA_MOE_PLAN` does), or set `expert_parallel_size=1`."
        )
    found = resolve_modules(model, "experts", patterns, "MoE", "layers.*.moe")
    for name in found:
        check_moe_module(name, model.get_submodule(name), expert_parallel_size)
    return found


def apply_experts(model: nn.Module, device_mesh: DeviceMesh, patterns: tuple[str, ...], **fsdp_overrides: Any) -> None:
    """Put every MoE module the patterns name on the mesh (before the blocks holding them are sharded)."""
    from modelpar.moe import parallelize_experts

    for name in moe_modules(model, patterns, 1):
        parallelize_experts(model.get_submodule(name), device_mesh, **fsdp_overrides)
