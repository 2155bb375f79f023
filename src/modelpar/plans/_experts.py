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

__all__ = ["apply_experts", "drop_expert_styles", "experts_name", "moe_modules"]


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


def experts_name(model: nn.Module, name: str) -> str:
    """The submodule holding the fused expert weights of the MoE module ``name``: ``name`` itself for a transformers
    experts module, else its ``experts`` child (``modelpar.models.moe.MoE``)."""
    from modelpar.moe._routed import is_routed_experts

    return name if is_routed_experts(model.get_submodule(name)) else f"{name}.experts"


def drop_expert_styles(styles: dict[str, Any], moe_names: list[str]) -> dict[str, Any]:
    """``styles`` without those on (or inside) the MoE modules: under expert parallelism their experts are whole on
    each expert rank and replicated over tensor parallelism, so a tensor-parallel style there (transformers'
    ``moe_tp_experts``) gives way."""
    return {n: s for n, s in styles.items() if not any(n == m or n.startswith(m + ".") for m in moe_names)}


def apply_experts(model: nn.Module, device_mesh: DeviceMesh, patterns: tuple[str, ...], **fsdp_overrides: Any) -> None:
    """Put every MoE module the patterns name on the mesh (before the blocks holding them are sharded)."""
    from modelpar.moe import parallelize_experts

    for name in moe_modules(model, patterns, 1):
        parallelize_experts(model.get_submodule(name), device_mesh, **fsdp_overrides)
