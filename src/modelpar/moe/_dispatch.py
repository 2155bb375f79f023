"""Tokens to their experts and back across the expert axis (all-to-all, uneven counts), and global router statistics.

:class:`ExpertParallel` is a ``modelpar.models.moe.MoE`` ``dispatch``. Per MoE layer and forward it costs, on the
expert axis, one all-to-all of the ``E`` per-expert token counts (int64) and two all-to-alls of the routed tokens
(dispatch and combine: ``tokens x top_k x dim`` elements per rank, minus what stays local), plus one all-reduce of
``2E + 2`` router statistics over the token ranks; backward repeats the two token all-to-alls (reversed) and the
all-reduce. Built on the public ``torch.distributed`` collectives, each wrapped in an autograd function whose
backward is the transposed collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from modelpar._mesh.submeshes import token_mesh
from modelpar.moe._layout import expert_parallel_mesh

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["ExpertParallel", "all_to_all", "sum_over_group"]


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
    """Send ``in_splits[j]`` rows of ``x`` to rank ``j`` of ``group``, receive ``out_splits[i]`` from rank ``i``.

    Differentiable: the gradient goes back by the reverse all-to-all.
    """
    result: torch.Tensor = _AllToAll.apply(x, out_splits, in_splits, group)
    return result


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def sum_over_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce sum of ``x``, differentiable: every rank's copy of the result feeds back into each input.

    Each rank then computes the same loss from the sum; its backward sums the ranks' (equal) gradients, which the
    data-parallel gradient average divides back out, leaving the one-process gradient.
    """
    result: torch.Tensor = _SumOverGroup.apply(x, group)
    return result


class ExpertParallel:
    """A MoE ``dispatch`` on the strategy's mesh: experts split over ``"expert_parallel"``, statistics over the tokens.

    With no expert axis (``expert_parallel_size=1``) the experts run locally and only the router statistics are
    summed over the token ranks (so the auxiliary losses are the global batch's, as on one process).
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        ep_mesh = expert_parallel_mesh(device_mesh)
        self.ep_size = ep_mesh.size() if ep_mesh is not None else 1
        self.ep_group = ep_mesh.get_group() if ep_mesh is not None else None
        tokens = token_mesh(device_mesh)
        self.token_group = tokens.get_group() if tokens.size() > 1 else None

    def sum_over_tokens(self, stats: torch.Tensor) -> torch.Tensor:
        return sum_over_group(stats, self.token_group) if self.token_group is not None else stats

    def __call__(
        self, tokens: torch.Tensor, counts: torch.Tensor, experts: Callable[[torch.Tensor, list[int]], torch.Tensor]
    ) -> torch.Tensor:
        """Dispatch ``tokens`` (sorted by global expert id, ``counts[e]`` per expert) and combine them, same order.

        ``experts(tokens, counts)`` runs this rank's experts on tokens grouped by local expert (``GroupedExperts``).
        """
        ep = self.ep_size
        if ep == 1:
            return experts(tokens, counts.tolist())
        local = counts.numel() // ep
        # received[i, l]: tokens rank i sends to my l-th local expert
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts.contiguous(), group=self.ep_group)
        received = received.view(ep, local)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received.sum(1).tolist()
        arrived = all_to_all(tokens, recv, send, self.ep_group)
        # arrived is grouped by (source rank, local expert); the experts want (local expert, source rank)
        chunks = arrived.split(received.flatten().tolist())
        by_expert = torch.cat([chunks[i * local + e] for e in range(local) for i in range(ep)])
        out = experts(by_expert, received.sum(0).tolist())
        chunks = out.split(received.t().flatten().tolist())
        by_source = torch.cat([chunks[e * ep + i] for i in range(ep) for e in range(local)])
        return all_to_all(by_source, send, recv, self.ep_group)
