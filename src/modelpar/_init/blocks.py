"""Which block of a full tensor a rank holds of a DTensor: shared by checkpoint loading and materialization.

Both cut this rank's part out of a full-size tensor without communication and without building anything
larger than that part: the checkpoint stream out of a memory-mapped file, materialization out of a
full-size draw. ``distribute_tensor(..., src_data_rank=None)`` would do the cutting too, but it splits
along every sharded axis (concatenating the data-parallel chunks of FSDP over TP, about twice the full
tensor), and it reads ``_StridedShard`` differently from FSDP2's own layout when sizes do not divide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

__all__ = ["local_block", "local_view", "shard_block"]


def _chunk(size: int, parts: int, index: int) -> tuple[int, int]:
    """(start, length) of piece ``index`` of ``torch.chunk`` over ``size`` elements, padded with empty pieces.

    ``Shard`` and FSDP2 both cut this way: pieces of ``ceil(size / parts)``, the last ones short or empty.
    """
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(step, size - start)


def local_block(
    shape: Sequence[int], coordinate: Sequence[int], mesh_sizes: Sequence[int], placements: Sequence[Placement]
) -> list[tuple[int, int]] | None:
    """(start, length) per tensor dim of the block a rank at ``coordinate`` owns; ``None``: a placement we don't cut.

    ``Shard(dim)`` on a mesh axis cuts the block so far along ``dim`` like ``torch.chunk`` into the axis size,
    axes left to right, as ``distribute_tensor`` does. ``_StridedShard(dim, split_factor)`` is what FSDP2
    puts on its axis when it shards a tensor-parallel DTensor on the dim TP already shards (FSDP over TP):
    there TP cut first and FSDP cut TP's piece, so it is applied after the ``Shard`` placements, on the
    piece they leave. That is FSDP2's layout, and ``full_tensor()`` reads it so; ``distribute_tensor`` reads
    the placement differently when the sizes do not divide (7 rows, tp=2, dp=3: dp rank 2 gets row 6 on
    tp rank 0, where FSDP2 keeps it on tp rank 1). We accept it only as FSDP2 builds it: ``split_factor``
    equal to the number of ``Shard`` pieces of that dim on the axes after it; anything else gets ``None``.
    """
    block = [(0, size) for size in shape]
    strided: list[tuple[int, int, int]] = []  # (mesh axis, dim, split factor)
    for axis, placement in enumerate(placements):
        # torch keeps _StridedShard private (not a Shard subclass in recent releases): recognise it by its
        # public attributes instead of importing it. Checked before Shard, which it subclasses in older torch.
        split_factor = getattr(placement, "split_factor", None)
        dim = getattr(placement, "dim", None)
        if split_factor is not None and isinstance(dim, int):
            strided.append((axis, dim % len(shape), int(split_factor)))
        elif isinstance(placement, Shard):
            dim = placement.dim % len(shape)
            start, length = block[dim]
            offset, length = _chunk(length, mesh_sizes[axis], coordinate[axis])
            block[dim] = (start + offset, length)
        elif not isinstance(placement, Replicate):
            return None
    for axis, dim, split_factor in strided:
        same_dim = [a for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim % len(shape) == dim]
        tp_pieces = math.prod(mesh_sizes[a] for a in same_dim if a != axis)
        if len(strided) > 1 or any(a < axis for a in same_dim) or split_factor != tp_pieces:
            return None
        start, length = block[dim]
        offset, length = _chunk(length, mesh_sizes[axis], coordinate[axis])
        block[dim] = (start + offset, length)
    return block


def shard_block(like: torch.Tensor) -> list[tuple[int, int]] | None:
    """(start, length) per dim of the block of the full tensor that this rank holds of ``like``.

    The whole tensor for a plain tensor; for a DTensor, the block :func:`local_block` computes (exactly
    FSDP2's layout, ``_StridedShard`` included), or ``None`` where it does not cut the placements or this
    rank is outside the mesh. For readers that fetch a block from storage themselves (a safetensors slice)
    instead of cutting a tensor in memory as :func:`local_view` does; the block's size must still
    be checked against ``like.to_local().shape``.
    """
    if not isinstance(like, DTensor):
        return [(0, size) for size in like.shape]
    mesh = like.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    return local_block(like.shape, coordinate, [mesh.size(axis) for axis in range(mesh.ndim)], like.placements)


def local_view(full: torch.Tensor, like: DTensor) -> torch.Tensor | None:
    """This rank's block of ``full`` as a view (``narrow`` per dim), shaped like ``like.to_local()``.

    ``None`` where :func:`shard_block` gives no block (placements it does not cut, a rank outside the mesh) or
    the block would not have the local shard's shape: the caller then falls back to ``distribute_tensor``.
    """
    block = shard_block(like)
    if block is None:
        return None
    local = full
    for dim, (start, length) in enumerate(block):
        local = local.narrow(dim, start, length)
    return local if local.shape == like.to_local().shape else None
