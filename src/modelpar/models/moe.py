"""A mixture-of-experts feed-forward for the Llama reference family: router, fused experts, dropless routing.

Each token goes to the ``top_k`` experts with the highest router probability (softmax over all experts, then top-k,
the k weights renormalized to sum to 1 when ``norm_topk``: Mixtral's and Qwen3-MoE's rule). Routing is dropless:
every token reaches its experts whatever the load (no capacity, no dropped tokens), so the result does not depend
on how tokens are spread over ranks. Expert weights are fused ``[experts, ...]`` tensors (torchtitan's
``GroupedExperts``), which expert parallelism splits along dim 0.

Two auxiliary losses, computed in every forward and summed by :class:`~modelpar.models.Llama` into ``aux_loss``:

- the Switch Transformer load-balancing loss ``E * sum_e f_e * P_e`` (``f_e``: the share of token-to-expert
  assignments expert ``e`` got, ``P_e``: its mean router probability), over the whole global batch;
- the router z-loss (ST-MoE) ``mean_t logsumexp(logits_t)^2``, which keeps router logits small.

Both are means over the global batch, like one process computes them on the whole batch. How the tokens of a
parallel run meet their experts, and how the per-rank statistics become global ones, is the module's ``dispatch``
attribute (like attention's ``attention_kernel``): :class:`LocalDispatch` for one process, replaced by
``modelpar.moe.ExpertParallel`` in a plan (all-to-all over the expert axis, one all-reduce of ``2E + 2`` statistics
over the token ranks). A plain attribute, not a submodule: names and checkpoints do not change.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["Dispatch", "GroupedExperts", "LocalDispatch", "MoE", "router_losses"]


class GroupedExperts(nn.Module):
    """SwiGLU experts as fused weights: ``w1``, ``w3`` ``[E, hidden, dim]`` and ``w2`` ``[E, dim, hidden]``.

    Under expert parallelism the weights are DTensors sharded along dim 0 over the expert axis; :meth:`forward`
    runs the local experts on their tokens (``to_local`` is differentiable, so gradients flow to the shard).
    """

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's default (kaiming uniform, a=sqrt(5)) per expert: bound 1/sqrt(fan_in).
        for weight in (self.w1, self.w3, self.w2):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``tokens`` grouped by local expert, ``counts[e]`` of them for the ``e``-th local expert; same shape out."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        if len(counts) != w1.shape[0]:
            raise ValueError(f"{len(counts)} token counts for {w1.shape[0]} local experts")
        outs = [
            (F.silu(chunk @ w1[e].t()) * (chunk @ w3[e].t())) @ w2[e].t()
            for e, chunk in enumerate(tokens.split(counts))
        ]
        return torch.cat(outs) if outs else tokens.new_zeros(tokens.shape)


class Dispatch(Protocol):
    """How a :class:`MoE` reaches its experts and sums router statistics (see the module docstring)."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        """Run ``experts`` on ``tokens`` (sorted by global expert id, ``counts[e]`` for expert ``e``), same order."""
        ...

    def sum_over_tokens(self, stats: torch.Tensor) -> torch.Tensor:
        """``stats`` summed over every rank that holds distinct tokens, differentiably (identity on one process)."""
        ...


class LocalDispatch:
    """One process: every expert is local and every token is here."""

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: GroupedExperts) -> torch.Tensor:
        return experts(tokens, counts.tolist())

    def sum_over_tokens(self, stats: torch.Tensor) -> torch.Tensor:
        return stats


def router_losses(
    logits: torch.Tensor, probs: torch.Tensor, chosen: torch.Tensor, dispatch: Dispatch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Load-balancing loss, z-loss and per-expert token counts over the global batch.

    ``logits``/``probs``: ``[tokens, E]`` (fp32); ``chosen``: ``[tokens, k]`` expert ids. The sums every rank
    contributes (probabilities per expert, assignments per expert, squared logsumexp, tokens) travel in one
    ``2E + 2`` vector through ``dispatch.sum_over_tokens``; the counts carry no gradient, the rest does.
    """
    n_experts, k = probs.shape[-1], chosen.shape[-1]
    counts = torch.bincount(chosen.flatten(), minlength=n_experts).to(probs.dtype)
    z = torch.logsumexp(logits, dim=-1).square().sum()
    stats = torch.cat([probs.sum(0), counts, z[None], probs.new_tensor([probs.shape[0]])])
    total = dispatch.sum_over_tokens(stats)
    n_tokens = total[-1]
    prob_share = total[:n_experts] / n_tokens
    token_share = total[n_experts : 2 * n_experts].detach() / (n_tokens * k)
    load_balance = n_experts * (token_share * prob_share).sum()
    return load_balance, total[2 * n_experts] / n_tokens, total[n_experts : 2 * n_experts].detach()


class MoE(nn.Module):
    """Router + fused experts with dropless top-k routing; records ``load_balance_loss`` and ``z_loss`` in forward."""

    def __init__(self, dim: int, hidden: int, n_experts: int, top_k: int, *, norm_topk: bool = True) -> None:
        super().__init__()
        if not 1 <= top_k <= n_experts:
            raise ValueError(
                f"MoE(n_experts={n_experts}, top_k={top_k}): each token picks top_k of the n_experts experts, so"
                " 1 <= top_k <= n_experts. Lower top_k or add experts."
            )
        self.n_experts, self.top_k, self.norm_topk = n_experts, top_k, norm_topk
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.experts = GroupedExperts(dim, hidden, n_experts)
        self.dispatch: Dispatch = LocalDispatch()
        self.load_balance_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        #: Tokens each expert received in the last forward, over the global batch (for load monitoring).
        self.expert_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        logits = self.router(tokens).float()
        probs = logits.softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert, tokens in order within one
        source = order // self.top_k
        counts = torch.bincount(flat, minlength=self.n_experts)
        out = self.dispatch(tokens[source], counts, self.experts)
        out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
        combined = torch.zeros_like(tokens).index_add(0, source, out)
        self.load_balance_loss, self.z_loss, self.expert_counts = router_losses(logits, probs, chosen, self.dispatch)
        return combined.view_as(x)
