"""The training loss under context (and data) parallelism: a token mean that gradient averaging makes global.

Ranks hold different numbers of real tokens (padding, ignored labels), so the mean of per-rank means is not the
mean over tokens. FSDP averages gradients over every rank that sees distinct tokens (data x context parallel),
so each rank returns its *sum* of token losses times that rank count divided by the global token count: the
averaged gradients are then exactly those of the mean over every non-ignored token of the global batch.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from modelpar._mesh.submeshes import token_mesh

__all__ = ["cross_entropy"]


def cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, device_mesh: DeviceMesh, *, ignore_index: int = -100
) -> torch.Tensor:
    """This rank's share of the global token-mean cross-entropy of ``logits`` ``(..., vocab)`` for ``labels`` ``(...)``.

    Returns ``sum of this rank's token losses * R / N``, where ``R`` is the number of token ranks
    (``"data_parallel_context_parallel"``, or ``"data_parallel"`` without context parallelism) and ``N`` the
    non-ignored tokens over them (one all-reduce of a count, no gradient). Backward and let the strategy average
    gradients; to log the global mean, average the returned value over the token ranks. Labels are not shifted
    here: shift them on the whole sequence first (``shard_batch(..., shift_labels=True)``).

    Vocab-sharded DTensor logits (loss parallelism) work inside ``modelpar.plans.loss_parallel(logits)``; the
    result is then a replicated DTensor.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"`logits` {tuple(logits.shape)} must be `labels` {tuple(labels.shape)} plus a vocabulary dim. Pass the"
            " labels of this rank's shard (from `shard_batch`), already shifted."
        )
    mesh = token_mesh(device_mesh)
    count = (labels != ignore_index).sum()
    if mesh.size() > 1:
        dist.all_reduce(count, group=mesh.get_group())
    total = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index, reduction="sum")
    factor = mesh.size() / count.clamp(min=1).to(torch.float32)
    if isinstance(total, DTensor):
        factor = DTensor.from_local(factor.to(total.dtype), total.device_mesh, [Replicate()] * total.device_mesh.ndim)
    return total * factor.to(total.dtype)
