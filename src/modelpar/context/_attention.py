"""Causal attention over sequence shards: local queries against all-gathered keys and values (as Llama 3 trained).

Each rank holds its two load-balanced query chunks (``_layout``). Keys and values are all-gathered along the
sequence with their own (key/value) head count, put into global order by a local reorder, and only then shared
among query heads (grouped-query attention inside SDPA, ``enable_gqa``), so the traffic and the tensor saved for
backward are key/value-heads sized (on CUDA with a padding mask the heads are repeated instead, see
:func:`share_kv_heads_in_sdpa`). In backward their gradients are reduce-scattered back to the owning rank.

Global chunk ``j`` of length ``c`` attends to keys ``[0, (j + 1) c)`` with the causal diagonal aligned to its
lower right (its last query sees every one of those keys): one SDPA call per local chunk, which needs no
collective beyond the two gathers and computes no fully masked block. Without padding the mask is torch's
lower-right causal bias (the flash kernel on CUDA); with padding, a bool mask. torch's ring attention
(``torch.distributed.tensor.experimental.context_parallel``) has no sharding rule for the CPU SDPA kernel, and
on GPUs gathering K/V costs a bounded amount of memory for sequences that fit (see docs/long-context.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.attention.bias import causal_lower_right

from modelpar._mesh.layout import CONTEXT_PARALLEL_AXIS
from modelpar.context._layout import check_sequence_length, context_mesh, gather_sequence

__all__ = ["ContextParallelAttention", "context_parallel_attention", "share_kv_heads_in_sdpa"]


def _check_inputs(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cp: int, key_padding_mask: torch.Tensor | None
) -> None:
    """Every check the kernel needs, on shapes every rank shares, before any collective: no rank hangs."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 4:
            raise ValueError(
                f"`{name}` has shape {tuple(t.shape)}, but the kernel takes SDPA's layout (batch, heads, seq_local,"
                " head_dim). Transpose (batch, seq, heads, head_dim) tensors with `.transpose(1, 2)`."
            )
    b, h, s, d = query.shape
    if key.shape != value.shape or key.shape[0] != b or key.shape[2] != s or key.shape[3] != d:
        raise ValueError(
            f"`query` {tuple(query.shape)}, `key` {tuple(key.shape)} and `value` {tuple(value.shape)} must share batch,"
            " local sequence length and head_dim (key and value may only have fewer heads)."
        )
    if h % key.shape[1]:
        raise ValueError(
            f"{h} query heads cannot share {key.shape[1]} key/value heads: grouped-query attention needs the number"
            " of query heads to be a multiple of the number of key/value heads (per tensor-parallel rank)."
        )
    if cp > 1:
        check_sequence_length(s * cp, cp, what=f"The global sequence ({cp} ranks x {s} local tokens)")
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"`key_padding_mask` has dtype {key_padding_mask.dtype}, but it must be bool (True = a real token)."
                " Pass `attention_mask.bool()`."
            )
        if tuple(key_padding_mask.shape) != (b, s * cp):
            raise ValueError(
                f"`key_padding_mask` has shape {tuple(key_padding_mask.shape)}, but the kernel honours only a padding"
                f" mask of shape (batch, global seq) = ({b}, {s * cp}), in global order and whole on every rank"
                " (`shard_batch` keeps it so). 4-D, additive or custom masks are not supported."
            )


def share_kv_heads_in_sdpa(device_type: str, masked: bool) -> bool:
    """Whether SDPA shares key/value heads itself (``enable_gqa``) rather than getting them repeated first.

    ``enable_gqa`` keeps the tensors saved for backward key/value-heads sized, but on CUDA only the flash and math
    kernels take it, and flash takes no mask: with a mask, SDPA would fall to the math kernel, which materializes
    every attention score. There, repeated heads let the memory-efficient kernel run instead (transformers decides
    alike). On CPU every kernel takes ``enable_gqa``.
    """
    return device_type != "cuda" or not masked


def _lower_right_bias(q_len: int, k_len: int) -> torch.Tensor | None:
    """torch's lower-right causal bias, which dispatches to the flash kernel on CUDA; ``None`` where it cannot exist.

    The bias is a tensor subclass that cannot be created while a ``TorchDispatchMode`` is active (``CommDebugMode``,
    selective activation checkpointing, FLOP counters): the caller then builds the same mask as a bool tensor.
    """
    try:
        return causal_lower_right(q_len, k_len)
    except RuntimeError:
        return None


def _chunk_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: torch.Tensor | None,
    scale: float | None,
) -> torch.Tensor:
    """Causal attention of ``q`` (the last ``q_len`` positions before ``k_len``) over keys ``[0, k_len)``."""
    q_len, k_len = q.shape[2], k.shape[2]
    groups = q.shape[1] // k.shape[1]
    bias = _lower_right_bias(q_len, k_len) if padding is None else None
    if bias is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=groups > 1)
    if groups > 1 and not share_kv_heads_in_sdpa(q.device.type, masked=True):
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    gqa = k.shape[1] != q.shape[1]
    mask = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).tril(k_len - q_len)
    if padding is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    mask = mask & padding[:, None, None, :]  # (b, 1, q_len, k_len)
    # A query with no key to attend to (a left-padding position) would give NaN: let it see every key, then zero
    # its output, so its output and the gradients through it are 0.
    seen = mask.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | ~seen, scale=scale, enable_gqa=gqa)
    return out.masked_fill(~seen, 0.0)


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    device_mesh: DeviceMesh | None,
    *,
    scale: float | None = None,
    key_padding_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's query shard over the whole sequence; SDPA layout ``(batch, heads, seq, dim)``.

    ``query``, ``key`` and ``value`` are this rank's load-balanced shards (``shard_sequence`` / ``shard_batch``
    layout, rotary embeddings applied at their global positions); ``key`` and ``value`` may have fewer heads
    (grouped-query attention). ``key_padding_mask``: an optional bool ``(batch, global seq)`` tensor in global
    order, the same on every context-parallel rank, True for a real token; a query that can see no real key gives
    zeros. ``device_mesh`` without a ``"context_parallel"`` axis (or of size 1): plain causal attention.
    Returns the output for the local queries, shaped like ``query``.
    """
    mesh = context_mesh(device_mesh)
    cp = 1 if mesh is None else mesh.size()
    _check_inputs(query, key, value, cp, key_padding_mask)
    if mesh is None:
        return _chunk_attention(query, key, value, key_padding_mask, scale)
    keys = gather_sequence(key, mesh, dim=2)
    values = gather_sequence(value, mesh, dim=2)
    rank, c = mesh.get_local_rank(), query.shape[2] // 2
    outs = []
    for local, chunk in enumerate((rank, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c
        padding = None if key_padding_mask is None else key_padding_mask[:, :end]
        q = query[:, :, local * c : (local + 1) * c]
        outs.append(_chunk_attention(q, keys[:, :, :end], values[:, :, :end], padding, scale))
    return torch.cat(outs, dim=2)


class ContextParallelAttention:
    """:func:`context_parallel_attention` bound to a mesh: the attention kernel a model's attention modules call.

    ``kernel(query, key, value, *, scale=None, key_padding_mask=None)`` in SDPA layout, causal, with key/value heads
    not yet repeated: the signature of a causal SDPA kernel, so a model can swap it in for its default one.
    """

    def __init__(self, device_mesh: DeviceMesh) -> None:
        names = tuple(device_mesh.mesh_dim_names or ())
        if CONTEXT_PARALLEL_AXIS not in names:
            raise ValueError(
                f"The mesh has axes {list(names)}, but context-parallel attention needs a"
                f' "{CONTEXT_PARALLEL_AXIS}" axis. Pass the strategy\'s `device_mesh` (with'
                ' `context_parallel_size > 1`) or a 1-D mesh named ("context_parallel",).'
            )
        self.device_mesh = device_mesh
        # Resolved once: the kernel runs in every attention layer of every step.
        self._context_mesh = context_mesh(device_mesh)

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        *,
        scale: float | None = None,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return context_parallel_attention(
            query, key, value, self._context_mesh, scale=scale, key_padding_mask=key_padding_mask
        )

    def __repr__(self) -> str:
        return f"ContextParallelAttention(cp={1 if self._context_mesh is None else self._context_mesh.size()})"
