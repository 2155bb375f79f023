"""Experts written like transformers' (fused ``[E, ...]`` weights, called with the routing) on the mesh.

transformers 5 gives every MoE family one experts module: fused weights whose dim 0 is the expert
(``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, GPT-OSS's biases ``[E, ...]``), a ``num_experts``
attribute, and ``forward(hidden_states, top_k_index, top_k_weights)`` that sends each of the ``N`` tokens to its
``k`` experts and sums their outputs, weighted. The router before it and the shared experts beside it stay as
they are. Two ways to split such a module, both whole experts per rank (``Shard(0)`` on the expert dim, a layout
DTensor checkpoints and reshards with public placements):

- over the **expert axis** (:func:`expert_parallel_experts`, ``expert_parallel_size > 1``): each rank routes
  its own tokens; the ``(token, slot)`` pairs go to the rank holding their expert and back by all-to-all
  (:class:`~modelpar.moe.ExpertParallel`, uneven counts);
- over the **tensor-parallel axis** (:class:`ExpertsOverTensorParallel`, transformers' ``moe_tp_experts``): the
  tensor-parallel ranks hold the same tokens, so each runs only the pairs of its own experts, and the partial
  sums meet in one all-reduce of the output (the row-wise layer's collective). transformers instead splits every
  expert's rows, which needs each rank to keep matching rows of the packed gate and up projections: a layout
  only torch's private ``_StridedShard`` expresses. Whole experts cost the same memory and the same
  collective, with whole matrix products per expert; the load per rank then follows the routing.

Either way the module's own ``forward`` runs unchanged on the local experts: it is called on a view of the
module whose parameters are the local blocks and whose ``num_experts`` is the local count, with the pairs'
tokens as its batch, one slot each (local expert id, weight 1). Each pair's output is weighted by its routing
weight afterwards and summed per token in expert order, which is the order transformers' loop sums them in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from modelpar.moe._dispatch import ExpertParallel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "ExpertsOverTensorParallel",
    "expert_parallel_experts",
    "is_routed_experts",
    "routed_experts_size",
    "shard_over",
]

#: The attribute transformers' experts modules hold their expert count in.
NUM_EXPERTS = "num_experts"


def routed_experts_size(module: nn.Module) -> int | None:
    """The expert count of a transformers-shaped experts module, or ``None`` for any other module.

    Such a module has an integer ``num_experts``, no ``dispatch`` (that is ``modelpar.models.moe.MoE``'s shape),
    and only parameters of its own whose dim 0 is that count.
    """
    count = getattr(module, NUM_EXPERTS, None)
    params = list(module.parameters(recurse=False))
    if not isinstance(count, int) or hasattr(module, "dispatch") or not params:
        return None
    return count if all(p.dim() >= 1 and p.shape[0] == count for p in params) else None


def is_routed_experts(module: nn.Module) -> bool:
    return routed_experts_size(module) is not None


class _LocalView:
    """``module`` as its forward sees it, with the local blocks as parameters and the local expert count."""

    __slots__ = ("_module", "_overrides")

    def __init__(self, module: nn.Module, overrides: dict[str, Any]) -> None:
        object.__setattr__(self, "_module", module)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_overrides")
        return overrides[name] if name in overrides else getattr(object.__getattribute__(self, "_module"), name)


def shard_over(module: nn.Module, mesh: DeviceMesh) -> None:
    """Replace each fused parameter by a DTensor ``Shard(0)`` over ``mesh``: each rank keeps whole experts."""
    for name, param in list(module.named_parameters(recurse=False)):
        sharded = distribute_tensor(param.detach(), mesh, [Shard(0)])
        module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))


def _local_runner(module: nn.Module, forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``run(tokens, local_ids, weight_dtype)``: the module's ``forward`` on its local experts, one slot per row."""

    def run(tokens: torch.Tensor, local_ids: torch.Tensor, weight_like: torch.Tensor) -> torch.Tensor:
        local: dict[str, Any] = {
            name: p.to_local() if isinstance(p, DTensor) else p for name, p in module.named_parameters(recurse=False)
        }
        local[NUM_EXPERTS] = next(iter(local.values())).shape[0]
        ones = weight_like.new_ones((tokens.shape[0], 1))
        out = forward(_LocalView(module, local), tokens, local_ids.unsqueeze(-1), ones)
        if tokens.shape[0] == 0:
            # No pair reached this rank's experts: transformers' eager loop then returns zeros that depend on nothing.
            # Keep the graph every rank has (the all-to-all's backward, FSDP's reduce-scatter of every expert
            # weight): other ranks would wait in those collectives for this one.
            anchor = sum(
                (p.sum() for p in local.values() if isinstance(p, torch.Tensor) and p.requires_grad), tokens.sum()
            )
            out = out + 0 * anchor
        return out

    return run


def _combine(hidden: torch.Tensor, source: torch.Tensor, out: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each pair's output times its routing weight, summed into its token's row (pairs in expert order)."""
    weighted = (out * weights.unsqueeze(-1)).to(hidden.dtype)
    return torch.zeros_like(hidden).index_add(0, source, weighted)


def _install(module: nn.Module, make: Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]) -> None:
    """Route the module's calls through ``make(run)``; hooks (FSDP's unshard) still run around it."""
    run = _local_runner(module, type(module).forward)
    module.forward = make(run)  # an instance attribute: names, checkpoints and hooks (FSDP) stay as they are


def expert_parallel_experts(module: nn.Module, device_mesh: DeviceMesh, ep_mesh: DeviceMesh) -> None:
    """Split a transformers experts module over ``ep_mesh`` and send its pairs there and back by all-to-all.

    Call before ``fully_shard(module)`` (over the ranks holding the same experts). ``device_mesh`` is the
    strategy's mesh (for :class:`~modelpar.moe.ExpertParallel`'s groups).
    """
    n_experts = routed_experts_size(module)
    assert n_experts is not None  # checked by the caller (check_moe_module); not user-facing
    shard_over(module, ep_mesh)
    dispatch = ExpertParallel(device_mesh)

    def make(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
            flat = top_k_index.flatten()
            order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within one
            source = order // top_k_index.shape[-1]
            counts = torch.bincount(flat, minlength=n_experts)

            def experts(tokens: torch.Tensor, local_counts: list[int]) -> torch.Tensor:
                ids = torch.repeat_interleave(
                    torch.arange(len(local_counts), device=tokens.device),
                    torch.tensor(local_counts, device=tokens.device),
                )
                return run(tokens, ids, top_k_weights)

            out = dispatch(hidden_states[source], counts, experts)
            return _combine(hidden_states, source, out, top_k_weights.flatten()[order])

        return forward

    _install(module, make)


class _SumForward(torch.autograd.Function):
    """Partial sums in, their sum over the mesh out; the gradient goes back as it is (replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        summed = DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()])
        return summed.to_local()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _sum_backward(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` unchanged; its gradient, partial on each rank (their own experts'), summed over ``mesh``."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class ExpertsOverTensorParallel(ParallelStyle):
    """transformers' ``moe_tp_experts`` as whole experts per tensor-parallel rank (see the module docstring).

    The module's fused parameters become DTensors ``Shard(0)`` over the tensor-parallel axis. Forward: the
    tokens and routing weights (the same on every tensor-parallel rank) go in unchanged, each rank runs the pairs
    routed to its experts, and one all-reduce sums the outputs. Backward: the gradients of the tokens and of the
    routing weights, each rank's for its own experts, are summed (two all-reduces), so the router and everything
    before it see the one-process gradient.
    """

    splits_parameters_dim = 0  # read by the memory estimate: each fused parameter is split along dim 0

    def sharded_dims(self, module: nn.Module) -> list[tuple[str, int]]:
        """What the plan's pre-flight check divides by the tensor-parallel size (``plans.sharded_dims``)."""
        n_experts = routed_experts_size(module)
        return [(NUM_EXPERTS, n_experts)] if n_experts is not None else []

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        n_experts = routed_experts_size(module)
        if n_experts is None:
            raise ValueError(
                f"The style 'moe_tp_experts' splits an experts module with fused [num_experts, ...] weights and a"
                f" `num_experts` attribute, but got {type(module).__name__}."
            )
        tp = device_mesh.size()
        if n_experts % tp:
            raise ValueError(
                f"`tensor_parallel_size={tp}` must divide the {n_experts} experts of {type(module).__name__}:"
                " tensor-parallel experts are split whole, the same number on each tensor-parallel rank."
            )
        shard_over(module, device_mesh)
        local = n_experts // tp
        first = device_mesh.get_local_rank() * local

        def make(run: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> Any:
                hidden = _sum_backward(hidden_states, device_mesh)
                weights = _sum_backward(top_k_weights, device_mesh).flatten()
                flat = top_k_index.flatten()
                mine = ((flat >= first) & (flat < first + local)).nonzero().squeeze(-1)
                pairs = mine[flat[mine].argsort(stable=True)]  # this rank's pairs, by expert, tokens in order
                source = pairs // top_k_index.shape[-1]
                out = run(hidden[source], flat[pairs] - first, top_k_weights)
                return _SumForward.apply(_combine(hidden, source, out, weights[pairs]), device_mesh)

            return forward

        _install(module, make)
        return module
