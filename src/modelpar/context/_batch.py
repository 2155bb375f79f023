"""Turning a batch of whole sequences into this rank's context-parallel shard.

Every rank of a context-parallel group receives the same samples (the sampler shards over data parallelism
only), so sharding is local slicing. What :func:`shard_batch` does, key by key:

* ``position_ids``: created as ``0 .. S-1`` when absent (rotary embeddings need each token's *global* position,
  which a model would otherwise derive from its local length), then sharded;
* ``labels``: with ``shift_labels=True`` shifted for causal language modelling on the whole sequence first
  (position ``p`` gets the label of ``p + 1``; the last position and padding get ``ignore_index``), since a model
  shifting its local shard would pair tokens that are not neighbours;
* the padding mask (``attention_mask``, shape ``(batch, S)``) is kept whole and made bool: attention needs the
  padding of every key, in global order;
* every other tensor whose size along ``seq_dim`` is ``S`` (``input_ids``, ``inputs_embeds``, ``labels``,
  ``loss_mask`` ...) is sharded into the load-balanced layout; any other value is passed through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from modelpar.context._layout import check_sequence_length, context_mesh, shard_sequence

__all__ = ["shard_batch", "shift_labels_for_causal_lm"]

#: The key of the padding mask (True or 1 = a real token), as Hugging Face tokenizers name it.
PADDING_MASK_KEY = "attention_mask"


def shift_labels_for_causal_lm(
    labels: torch.Tensor, padding_mask: torch.Tensor | None = None, *, ignore_index: int = -100, seq_dim: int = 1
) -> torch.Tensor:
    """Labels for next-token prediction: position ``p`` gets ``labels[p + 1]``; the last gets ``ignore_index``.

    With a ``padding_mask`` a position is ignored when it or the next one is padding: a padding query has no
    context (left padding) and a padding label is no token (right padding).
    """
    seq_dim = seq_dim % labels.dim()
    shifted = torch.full_like(labels, ignore_index)
    n = labels.shape[seq_dim]
    shifted.narrow(seq_dim, 0, n - 1).copy_(labels.narrow(seq_dim, 1, n - 1))
    if padding_mask is not None:
        real = padding_mask.bool()
        keep = torch.zeros_like(real)
        keep.narrow(seq_dim, 0, n - 1).copy_(real.narrow(seq_dim, 0, n - 1) & real.narrow(seq_dim, 1, n - 1))
        shifted = shifted.masked_fill(~keep, ignore_index)
    return shifted


def _reference(batch: Mapping[str, Any]) -> torch.Tensor:
    """The tensor whose length along the sequence dim is the sequence length."""
    for key in ("input_ids", "inputs_embeds", "labels", PADDING_MASK_KEY):
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError(
        f"The batch has keys {sorted(batch)}, but `shard_batch` reads the sequence length from `input_ids`,"
        f" `inputs_embeds`, `labels` or `{PADDING_MASK_KEY}`, and none of them is a tensor. Add `input_ids`."
    )


def shard_batch(
    batch: Mapping[str, Any],
    device_mesh: DeviceMesh | None,
    *,
    seq_dim: int = 1,
    shift_labels: bool = False,
    ignore_index: int = -100,
) -> dict[str, Any]:
    """This rank's shard of ``batch`` (see the module docstring for what happens to each key).

    Validates on every rank before anything else (no communication at all): the sequence length must be a
    multiple of ``2 x cp`` and the padding mask ``(batch, S)`` with 0/1 or bool values. With ``shift_labels`` and
    no ``labels``, the labels are the shifted ``input_ids``. Without context parallelism the batch is only
    completed (positions, shifted labels), so one training step serves both.
    """
    mesh = context_mesh(device_mesh)
    cp = 1 if mesh is None else mesh.size()
    reference = _reference(batch)
    seq_len = int(reference.shape[seq_dim])
    if cp > 1:
        check_sequence_length(seq_len, cp, what="The batch's sequence")
    out: dict[str, Any] = dict(batch)
    padding = out.get(PADDING_MASK_KEY)
    if padding is not None:
        if not isinstance(padding, torch.Tensor) or padding.dim() != 2 or padding.shape[1] != seq_len:
            shape = tuple(padding.shape) if isinstance(padding, torch.Tensor) else type(padding).__name__
            raise ValueError(
                f"`{PADDING_MASK_KEY}` is {shape}, but context parallelism takes a 2-D padding mask (batch, {seq_len})"
                " (True or 1 = a real token). 4-D or custom attention masks are not supported."
            )
        if padding.dtype != torch.bool:
            if not bool(((padding == 0) | (padding == 1)).all()):
                raise ValueError(
                    f"`{PADDING_MASK_KEY}` holds values other than 0 and 1, but context parallelism only honours a"
                    " padding mask (1 = a real token, 0 = padding). Pass a 0/1 or bool mask."
                )
            padding = padding.bool()
        out[PADDING_MASK_KEY] = padding
    if out.get("position_ids") is None:
        # (batch, S) for token ids (b, S) and embeddings (b, S, hidden) alike.
        positions = torch.arange(seq_len, device=reference.device).view(*[1] * seq_dim, seq_len)
        out["position_ids"] = positions.expand(*reference.shape[: seq_dim + 1])
    if shift_labels:
        labels = out.get("labels", out.get("input_ids"))
        if not isinstance(labels, torch.Tensor):
            raise ValueError("`shift_labels=True` needs `labels` or `input_ids` in the batch, but it has neither.")
        out["labels"] = shift_labels_for_causal_lm(labels, padding, ignore_index=ignore_index, seq_dim=seq_dim)
    for key, value in out.items():
        if key == PADDING_MASK_KEY or not isinstance(value, torch.Tensor):
            continue
        if value.dim() > seq_dim and value.shape[seq_dim] == seq_len:
            out[key] = shard_sequence(value, mesh, dim=seq_dim)
    return out
