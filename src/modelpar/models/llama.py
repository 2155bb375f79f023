"""A compact Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU), with an optional MoE variant.

Module names follow torchtitan's (``attention.wq``, ``feed_forward.w1`` ...) so that
``modelpar.plans.llama`` applies to it and to models written the same way. Every module that owns
tensors defines ``reset_parameters()``, so the model can be built on the meta device and materialized
shard by shard. Attention reshapes with ``-1`` heads, so it runs unchanged on tensor-parallel shards.

``LlamaConfig(n_experts=E, top_k=k)`` makes the feed-forward of every ``moe_every``-th block a mixture of experts
(``layers.*.moe``, torchtitan's Llama 4 naming; see ``modelpar.models.moe``); after each forward the model's
``aux_loss`` holds ``aux_loss_coef x`` load-balancing loss ``+ z_loss_coef x`` router z-loss, summed over its MoE
blocks, for the training loss to add.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from modelpar.models.moe import MoE

__all__ = ["Llama", "LlamaConfig", "causal_attention"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    #: Experts per MoE feed-forward; 0: a dense model.
    n_experts: int = 0
    top_k: int = 2
    #: Hidden size of each expert; 0: ``ffn_hidden``.
    moe_hidden: int = 0
    #: Every ``moe_every``-th block (the 1st, ``1 + moe_every``-th, ...) has a MoE feed-forward, the rest dense.
    moe_every: int = 1
    #: Renormalize the top-k router probabilities to sum to 1 (Mixtral, Qwen3-MoE).
    norm_topk: bool = True
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables as non-persistent buffers: recomputed on materialization, never checkpointed."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        device = self.cos.device
        freqs = 1.0 / (self.theta ** (torch.arange(0, self.head_dim, 2, device=device).float() / self.head_dim))
        angles = torch.outer(torch.arange(self.max_seq_len, device=device).float(), freqs)
        with torch.no_grad():
            self.cos.copy_(angles.cos())
            self.sin.copy_(angles.sin())

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate ``x`` of shape (batch, seq, heads, head_dim) by position: ``0 .. seq-1``, or ``positions``.

        ``positions`` (``(seq,)`` or ``(batch, seq)``, global token indices) is what a sequence shard needs: under
        context parallelism a rank holds tokens from two places of the sequence, not the first ``seq``.
        """
        if positions is None:
            cos, sin = self.cos[: x.shape[1], None, :], self.sin[: x.shape[1], None, :]
        else:
            cos, sin = self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)
        x1, x2 = x.float()[..., 0::2], x.float()[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
        return rotated.type_as(x)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on ``(batch, heads, seq, head_dim)``; ``key``/``value`` may have fewer (grouped) heads."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(n_rep, dim=1), value.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(query, key, value, is_causal=True)


class Attention(nn.Module):
    """Grouped-query attention whose kernel is an attribute, so context parallelism can replace it.

    ``attention_kernel(query, key, value)`` takes ``(batch, heads, seq, head_dim)`` tensors with the key/value
    heads not yet repeated (a kernel that gathers them across ranks moves the small grouped tensors) and
    returns the output in the query's layout. A plain attribute, not a submodule: names and checkpoints do not
    change when ``modelpar.plans`` swaps in ``modelpar.context.ContextParallelAttention``.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.attention_kernel: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_attention
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor | None = None) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: with tensor parallelism each rank holds n_heads / tp of them.
        q = rope(self.wq(x).view(bs, seq, -1, self.head_dim), positions)
        k = rope(self.wk(x).view(bs, seq, -1, self.head_dim), positions)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        out = self.attention_kernel(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe: MoE | None = None
        self.feed_forward: FeedForward | None = None
        if cfg.n_experts and layer_id % cfg.moe_every == 0:
            hidden = cfg.moe_hidden or cfg.ffn_hidden
            self.moe = MoE(cfg.dim, hidden, cfg.n_experts, cfg.top_k, norm_topk=cfg.norm_topk)
        else:
            self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding, positions: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope, positions)
        ffn = self.moe if self.moe is not None else self.feed_forward
        assert ffn is not None  # one of them is set in __init__; not user-facing
        return h + ffn(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
            raise ValueError(
                f"LlamaConfig(dim={cfg.dim}, n_heads={cfg.n_heads}, n_kv_heads={cfg.n_kv_heads}): dim must be a"
                " multiple of n_heads, and n_heads a multiple of n_kv_heads."
            )
        if cfg.n_experts < 0 or cfg.moe_every < 1:
            raise ValueError(
                f"LlamaConfig(n_experts={cfg.n_experts}, moe_every={cfg.moe_every}): n_experts must be >= 0 (0: dense)"
                " and moe_every >= 1."
            )
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.layers = nn.ModuleList(TransformerBlock(cfg, layer_id) for layer_id in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        #: After a forward of a MoE model: the weighted auxiliary losses of its MoE blocks (add it to the loss).
        self.aux_loss: torch.Tensor | None = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, seq, vocab) for ``tokens`` of shape (batch, seq).

        As a pipeline stage: hidden states in (stages after the first), hidden states out (stages before the last).

        ``positions``: the tokens' indices in their sequence (``(seq,)`` or ``(batch, seq)``), for a sequence
        shard under context parallelism (``modelpar.context.shard_batch`` makes them); ``0 .. seq-1`` if left out.
        """
        # A pipeline stage (``modelpar.pipeline``) holds some of the modules, the others are None: without the
        # embedding the input is the previous stage's hidden states, without the output layer they are returned.
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        aux: list[torch.Tensor] = []
        for layer in self.layers:
            h = layer(h, self.rope, positions)
            moe = getattr(layer, "moe", None)
            if isinstance(moe, MoE) and moe.load_balance_loss is not None and moe.z_loss is not None:
                aux.append(self.config.aux_loss_coef * moe.load_balance_loss + self.config.z_loss_coef * moe.z_loss)
        self.aux_loss = torch.stack(aux).sum() if aux else None
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h
