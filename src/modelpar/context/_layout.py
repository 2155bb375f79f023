"""Where each token of a sequence lives under context parallelism: the load-balanced causal layout.

A causal attention row costs as many keys as its position, so cutting the sequence into ``cp`` contiguous
shards would give the last rank ``2cp - 1`` times the work of the first. Instead the sequence of length ``S``
is cut into ``2cp`` chunks of ``c = S / 2cp`` tokens and rank ``i`` (its coordinate on the
``"context_parallel"`` axis) holds chunks ``i`` and ``2cp - 1 - i``, in that order::

    cp = 2, S = 8, c = 2     chunks  [0 1 | 2 3 | 4 5 | 6 7]
    rank 0 holds chunks 0, 3 -> positions [0 1 6 7]   (its queries see 2 + 8 keys)
    rank 1 holds chunks 1, 2 -> positions [2 3 4 5]   (its queries see 4 + 6 keys)

so every rank attends to ``(2cp + 1) c`` keys per query row pair: the work is balanced (Llama 3 trained so).

Sharding is a local slice (every rank of a context-parallel group has the whole batch); unsharding is one
all-gather along the sequence followed by a local reorder into global order. ``device_mesh`` is either a strategy
mesh with a ``"context_parallel"`` axis or a 1-D mesh whose only axis has that name; a mesh without the axis,
or one of size 1, means no context parallelism, and these functions return their input.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from modelpar._mesh.submeshes import context_parallel_mesh

__all__ = [
    "check_sequence_length",
    "context_mesh",
    "gather_sequence",
    "load_balanced_positions",
    "shard_sequence",
    "unshard_sequence",
]


def context_mesh(device_mesh: DeviceMesh | None) -> DeviceMesh | None:
    """The 1-D context-parallel axis of ``device_mesh``, or ``None`` when there is none or it holds one rank."""
    mesh = context_parallel_mesh(device_mesh) if device_mesh is not None else None
    return mesh if mesh is not None and mesh.size() > 1 else None


def check_sequence_length(seq_len: int, cp_size: int, *, what: str = "The sequence") -> None:
    """Raise the ``ValueError`` every rank raises alike when ``seq_len`` cannot be cut into ``2 * cp_size`` chunks."""
    if cp_size < 1:
        raise ValueError(f"The context-parallel size must be positive, got {cp_size}.")
    chunks = 2 * cp_size
    if seq_len % chunks or seq_len == 0:
        fit = -(-max(seq_len, 1) // chunks) * chunks
        raise ValueError(
            f"{what} has length {seq_len}, but context parallelism over {cp_size} ranks cuts it into"
            f" 2 x {cp_size} = {chunks} equal chunks, so its length must be a positive multiple of {chunks}."
            f" Pad the sequences to a multiple of {chunks} (e.g. {fit}; padding is masked by the padding mask)."
        )


def load_balanced_positions(seq_len: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions context-parallel rank ``cp_rank`` holds, in its local order (a ``LongTensor``).

    Chunk ``cp_rank`` then chunk ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size`` equal chunks: these are the
    ``position_ids`` its tokens need for rotary embeddings.
    """
    check_sequence_length(seq_len, cp_size)
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"`cp_rank={cp_rank}` is not a rank of a context-parallel group of {cp_size}.")
    c = seq_len // (2 * cp_size)
    late = 2 * cp_size - 1 - cp_rank
    return torch.cat([torch.arange(cp_rank * c, (cp_rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


def shard_sequence(t: torch.Tensor, device_mesh: DeviceMesh | None, *, dim: int = 1) -> torch.Tensor:
    """This rank's load-balanced shard of ``t`` along ``dim`` (two slices, no communication; autograd-aware)."""
    mesh = context_mesh(device_mesh)
    if mesh is None:
        return t
    cp, rank = mesh.size(), mesh.get_local_rank()
    check_sequence_length(t.shape[dim], cp)
    chunks = t.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def gather_sequence(t_local: torch.Tensor, mesh: DeviceMesh, *, dim: int) -> torch.Tensor:
    """All-gather the shards of the 1-D context axis ``mesh`` along ``dim`` and put them in global order.

    Forward: one all-gather. Backward: one reduce-scatter that *sums* every rank's gradient for each shard
    (``grad_placements=[Partial()]``): without it each rank would keep only its own contribution and the
    gradients of keys and values would be silently wrong. The reorder is a local cat of views.
    """
    cp = mesh.size()
    dim = dim % t_local.dim()
    # Gathered along a new leading dim: the all-gather writes each rank's shard contiguously (gathering along
    # ``dim`` itself would cost torch an extra copy to interleave them) and the reorder below is the only copy.
    stacked = (
        DTensor.from_local(t_local.contiguous().unsqueeze(0), mesh, [Shard(0)], run_check=False)
        .redistribute(mesh, [Replicate()])
        .to_local(grad_placements=[Partial()])
    )
    # Rank r's shard holds chunk r then chunk 2cp - 1 - r: chunk j < cp is rank j's first half, chunk j >= cp
    # is rank 2cp - 1 - j's second half.
    halves = [shard.chunk(2, dim=dim) for shard in stacked.unbind(0)]
    return torch.cat([halves[j][0] if j < cp else halves[2 * cp - 1 - j][1] for j in range(2 * cp)], dim=dim)


def unshard_sequence(t_local: torch.Tensor, device_mesh: DeviceMesh | None, *, dim: int = 1) -> torch.Tensor:
    """The whole sequence in global order from every rank's shard (an all-gather; for evaluation and generation).

    Autograd-aware: backward sums the gradients that every rank's copy receives and hands each rank the part of
    its own shard. So a loss that every rank computes identically from the gathered tensor counts ``cp`` times;
    compute training losses on the shards (:func:`modelpar.context.cross_entropy`) instead.
    """
    mesh = context_mesh(device_mesh)
    if mesh is None:
        return t_local
    if t_local.shape[dim] % 2:
        raise ValueError(
            f"A load-balanced shard holds two equal chunks, but this tensor has {t_local.shape[dim]} entries along"
            f" dim {dim}. Pass the `dim` of the sequence (the tensor `shard_sequence` or `shard_batch` gave)."
        )
    return gather_sequence(t_local, mesh, dim=dim)
