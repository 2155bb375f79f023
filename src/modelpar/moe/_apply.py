"""Put MoE modules on the mesh: pre-flight checks, experts split over the expert axis and FSDP-sharded, dispatch.

A MoE module, for this package, is either of two shapes:

- a ``dispatch`` attribute (replaced here by :class:`ExpertParallel`) and an ``experts`` submodule whose
  parameters are fused ``[n_experts, ...]`` tensors (``modelpar.models.moe.MoE``, and models written the same way);
- a transformers experts module itself (``...mlp.experts``: fused ``[num_experts, ...]`` parameters, a
  ``num_experts`` attribute, called with the routing; :mod:`modelpar.moe._routed`).

The checks read attributes and shapes only, so every rank raises the same error before any collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from modelpar._train.fsdp import fsdp_kwargs
from modelpar.moe._dispatch import ExpertParallel
from modelpar.moe._layout import expert_fsdp_mesh, expert_parallel_mesh, token_ranks
from modelpar.moe._routed import expert_parallel_experts, routed_experts_size, shard_over

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["DISPATCH_ATTRIBUTE", "check_moe_module", "parallelize_experts", "sum_reduction_needed"]

#: The attribute a MoE module routes through: ``(tokens, counts, experts) -> out`` plus ``sum_over_tokens``.
DISPATCH_ATTRIBUTE = "dispatch"


def _experts(name: str, module: nn.Module) -> tuple[nn.Module, int]:
    routed = routed_experts_size(module)
    if routed is not None:
        return module, routed
    experts = getattr(module, "experts", None)
    if not hasattr(module, DISPATCH_ATTRIBUTE) or not isinstance(experts, nn.Module):
        raise ValueError(
            f"{name!r} ({type(module).__name__}) is named as a MoE module, but it has no `{DISPATCH_ATTRIBUTE}`"
            " attribute and `experts` submodule, and it is no transformers experts module (fused [num_experts, ...]"
            " parameters and a `num_experts` attribute), so its tokens cannot be sent to experts on other ranks."
            " Name the modules like `modelpar.models.moe.MoE` (e.g. 'layers.*.moe') or transformers' experts"
            " (e.g. 'model.layers.*.mlp.experts'), or give yours one of those shapes."
        )
    params = list(experts.parameters(recurse=False))
    sizes = {p.shape[0] for p in params}
    if not params or len(sizes) != 1:
        raise ValueError(
            f"{name}.experts ({type(experts).__name__}) must hold fused expert weights [n_experts, ...] as its own"
            f" parameters, but has {[tuple(p.shape) for p in params]}."
        )
    return experts, sizes.pop()


def sum_reduction_needed(backend: str, shard_ranks: int) -> bool:
    """Whether FSDP2 must reduce expert gradients with SUM and divide apart, rather than one ``PREMUL_SUM``.

    A divide factor other than the FSDP group's size (here: every token rank) makes FSDP2 use ``PREMUL_SUM``, which
    only NCCL implements; gloo (and others) raise at the first backward. SUM, then a division, works everywhere,
    except on a one-rank shard group (``ep`` = every shard rank): there FSDP2 (torch 2.13) skips the reduce-scatter
    and divides by the factor while copying, then divides again after, so the plain path must stay (it sends nothing).
    """
    return backend != "nccl" and shard_ranks > 1


def check_moe_module(name: str, module: nn.Module, expert_parallel_size: int) -> None:
    """Raise ``ValueError`` unless ``module`` is a MoE module whose experts split evenly over the expert axis.

    Also refuses a ``top_k`` above the experts (no routing can pick more experts than exist). A ``top_k`` above the
    experts of one rank is fine: routing is dropless, a token's ``k`` copies go to as many ranks as they need.
    """
    _, n_experts = _experts(name, module)
    top_k = getattr(module, "top_k", None)
    if isinstance(top_k, int) and top_k > n_experts:
        raise ValueError(
            f"{name!r}: top_k={top_k} is more than its {n_experts} experts; each token picks top_k distinct experts."
            " Lower top_k or add experts."
        )
    if n_experts % expert_parallel_size:
        fits = [d for d in range(1, n_experts + 1) if n_experts % d == 0]
        raise ValueError(
            f"`expert_parallel_size={expert_parallel_size}` must divide the number of experts, but {name!r} has"
            f" {n_experts}: each rank of the expert axis holds the same number of whole experts. Choose it among"
            f" {fits}, or change the model."
        )


def parallelize_experts(module: nn.Module, device_mesh: DeviceMesh, **fsdp_overrides: Any) -> nn.Module:
    """Put one MoE module on the strategy's mesh; call it before ``fully_shard`` of the block that holds it.

    With an expert axis: each fused expert weight becomes a DTensor ``Shard(0)`` over ``"expert_parallel"`` (each
    rank keeps ``n_experts / ep`` whole experts), and ``fully_shard(module.experts, ...)`` shards those over the ranks
    that hold the same experts (:func:`expert_fsdp_mesh`, with the strategy's FSDP2 policies and
    ``fsdp_overrides``). Their gradients are divided by every token rank, not only that FSDP group: the
    all-to-all's backward already summed the expert-axis ranks' tokens. Always, when more than one rank sees
    distinct tokens: the module's ``dispatch`` becomes :class:`ExpertParallel` (the all-to-all, and router
    statistics over the global batch). A transformers experts module is itself split and dispatched
    (:func:`modelpar.moe._routed.expert_parallel_experts`); its router losses are the model's own. Returns ``module``.
    """
    ep_mesh = expert_parallel_mesh(device_mesh)
    ep = ep_mesh.size() if ep_mesh is not None else 1
    check_moe_module(type(module).__name__, module, ep)
    experts, _ = _experts(type(module).__name__, module)
    routed = experts is module  # a transformers experts module: routed by its parent, dispatched here
    if ep_mesh is not None and ep > 1:
        if routed:
            expert_parallel_experts(experts, device_mesh, ep_mesh)
        else:
            shard_over(experts, ep_mesh)
        shard_mesh = expert_fsdp_mesh(device_mesh)
        fully_shard(experts, **fsdp_kwargs(device_mesh, **{**fsdp_overrides, "mesh": shard_mesh}))
        assert isinstance(experts, FSDPModule)  # fully_shard changed its class; not user-facing
        experts.set_gradient_divide_factor(float(token_ranks(device_mesh)))
        if sum_reduction_needed(str(dist.get_backend(ep_mesh.get_group())), shard_mesh.size(shard_mesh.ndim - 1)):
            experts.set_force_sum_reduction_for_comms(True)
    if not routed and (ep > 1 or token_ranks(device_mesh) > 1):
        setattr(module, DISPATCH_ATTRIBUTE, ExpertParallel(device_mesh))
    return module
