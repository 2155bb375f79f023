"""The MoE variant of the Llama reference family, in one process: routing, dropless experts, auxiliary losses.

The vectorized forward (sort by expert, fused weights, ``index_add`` back) is checked against a per-token loop
written straight from the definitions; the losses against their formulas; the statistics a parallel run sums
over ranks against the whole batch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from modelpar.models import Llama, LlamaConfig
from modelpar.models.moe import MoE, router_losses

DIM, HIDDEN, E = 16, 24, 6


def make_moe(top_k: int, norm_topk: bool = True) -> MoE:
    torch.manual_seed(0)
    return MoE(DIM, HIDDEN, E, top_k, norm_topk=norm_topk)


def loop_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax over all experts, top-k, renormalize, weighted sum of SwiGLU experts."""
    out = torch.zeros_like(x)
    w1, w2, w3 = moe.experts.w1, moe.experts.w2, moe.experts.w3
    for t in range(x.shape[0]):
        probs = F.softmax(moe.router(x[t]).float(), dim=-1)
        weights, chosen = probs.topk(moe.top_k)
        if moe.norm_topk:
            weights = weights / weights.sum()
        for weight, e in zip(weights, chosen.tolist(), strict=True):
            out[t] += weight * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    return out


@pytest.mark.parametrize(("top_k", "norm_topk"), [(1, False), (2, True), (2, False), (6, True)])
def test_dropless_top_k_routing_equals_a_per_token_loop(top_k, norm_topk):
    moe = make_moe(top_k, norm_topk)
    x = torch.randn(2, 7, DIM, generator=torch.Generator().manual_seed(1))
    got = moe(x)
    want = loop_reference(moe, x.reshape(-1, DIM)).view_as(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert int(moe.expert_counts.sum()) == 14 * top_k  # dropless: every (token, slot) pair reached an expert


def test_load_balancing_and_z_loss_follow_their_definitions():
    moe = make_moe(2)
    x = torch.randn(20, DIM, generator=torch.Generator().manual_seed(2))
    moe(x)
    logits = moe.router(x).float()
    probs = logits.softmax(-1)
    chosen = probs.topk(2).indices
    share = torch.stack([(chosen == e).sum() for e in range(E)]).float() / (20 * 2)
    want_lb = E * (share * probs.mean(0)).sum()
    want_z = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(moe.load_balance_loss, want_lb)
    torch.testing.assert_close(moe.z_loss, want_z)


class _SumOfShards:
    """Plays the token ranks: the statistics of the other shards are added in, as the all-reduce would."""

    def __init__(self, others: list[torch.Tensor]) -> None:
        self.others = others

    def sum_over_tokens(self, stats: torch.Tensor) -> torch.Tensor:
        return stats + sum(self.others)


def test_losses_from_summed_shard_statistics_equal_the_whole_batch():
    """What each rank computes from the summed statistics is the global-batch loss, not a mean of local ones."""
    moe = make_moe(2)
    x = torch.randn(24, DIM, generator=torch.Generator().manual_seed(3))
    logits = moe.router(x).float()
    probs = logits.softmax(-1)
    chosen = probs.topk(2).indices

    class Identity:
        def sum_over_tokens(self, stats: torch.Tensor) -> torch.Tensor:
            return stats

    whole = router_losses(logits, probs, chosen, Identity())  # type: ignore[arg-type]
    shards = [slice(0, 5), slice(5, 24)]  # uneven token counts per rank
    captured: list[torch.Tensor] = []

    class Capture:
        def sum_over_tokens(self, stats: torch.Tensor) -> torch.Tensor:
            captured.append(stats)
            return stats

    for s in shards:
        router_losses(logits[s], probs[s], chosen[s], Capture())  # type: ignore[arg-type]
    for index, s in enumerate(shards):
        others = [c for i, c in enumerate(captured) if i != index]
        got = router_losses(logits[s], probs[s], chosen[s], _SumOfShards(others))  # type: ignore[arg-type]
        for g, w in zip(got, whole, strict=True):
            torch.testing.assert_close(g, w)
    local_mean = sum(router_losses(logits[s], probs[s], chosen[s], Identity())[0] for s in shards) / 2  # type: ignore[arg-type]
    assert not torch.allclose(local_mean, whole[0])  # the per-rank definition would differ from one process


def test_the_llama_moe_variant_adds_weighted_aux_losses_and_keeps_dense_names():
    cfg = LlamaConfig(vocab_size=32, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2, moe_every=2)
    model = Llama(cfg)
    assert [layer.moe is not None for layer in model.layers] == [True, False, True]
    names = set(dict(model.named_parameters()))
    assert "layers.0.moe.experts.w1" in names and "layers.1.feed_forward.w1.weight" in names
    assert model.layers[0].moe.experts.w1.shape == (4, cfg.ffn_hidden, 16)
    model(torch.randint(0, 32, (2, 5)))
    moes = [model.layers[0].moe, model.layers[2].moe]
    want = sum(cfg.aux_loss_coef * m.load_balance_loss + cfg.z_loss_coef * m.z_loss for m in moes)
    torch.testing.assert_close(model.aux_loss, want)
    dense = Llama(LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=4, n_kv_heads=2))
    dense(torch.randint(0, 32, (1, 3)))
    assert dense.aux_loss is None
    assert not any(".moe." in n for n, _ in dense.named_parameters())


def test_top_k_larger_than_the_experts_is_refused_with_the_values():
    with pytest.raises(ValueError, match=r"MoE\(n_experts=4, top_k=5\).*1 <= top_k <= n_experts"):
        Llama(LlamaConfig(n_experts=4, top_k=5))
    with pytest.raises(ValueError, match=r"n_experts must be >= 0"):
        Llama(LlamaConfig(n_experts=-1))
