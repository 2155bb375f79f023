"""A marker value in freshly allocated tensors, so that materialization can tell what no initializer wrote.

Every tensor that materialization allocates (and every full-size stand-in it hands an initializer) is filled
with a marker first; an element that still holds it afterwards was written by nobody. Version counters cannot
tell: ``tensor.data`` has a counter of its own, and ``module.weight.data.normal_()`` is how much
initialization code is written. The marker is, for floating-point dtypes, a quiet NaN with a payload of its own
(no initializer draws it, and arithmetic on it stays NaN), and for 16- to 64-bit integers the dtype's minimum.
Other dtypes (bool, 8-bit, complex) have no value to spare: they are not marked, and count as written.

Compared bit for bit through an integer view, so NaNs an initializer writes on purpose are not mistaken for it.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["mark_unwritten", "merge_written", "unwritten_mask"]

#: dtype -> (integer dtype of the same size to view it as, the marker's bits as that integer)
_MARKERS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FF8_A5A5_A5A5_A5A5),
    torch.float32: (torch.int32, 0x7FC5_A5A5),
    torch.float16: (torch.int16, 0x7E5A),
    torch.bfloat16: (torch.int16, 0x7FDA),
    torch.int64: (torch.int64, -(2**63)),
    torch.int32: (torch.int32, -(2**31)),
    torch.int16: (torch.int16, -(2**15)),
}


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def mark_unwritten(t: torch.Tensor) -> None:
    """Fill ``t`` (this rank's shard, for a DTensor) with its dtype's marker; leave an unmarked dtype as it is."""
    marker = _MARKERS.get(t.dtype)
    if marker is not None:
        with torch.no_grad():
            _local(t).view(marker[0]).fill_(marker[1])


def unwritten_mask(t: torch.Tensor) -> torch.Tensor | None:
    """Where ``t`` (this rank's shard, for a DTensor) still holds the marker; ``None`` for an unmarked dtype."""
    marker = _MARKERS.get(t.dtype)
    if marker is None:
        return None
    return _local(t).view(marker[0]) == marker[1]


def merge_written(target: torch.Tensor, source: torch.Tensor) -> bool:
    """Copy ``source`` into ``target`` (same shape) except where ``source`` still holds the marker.

    What an initializer left unwritten in a stand-in keeps the value it had before (written by an earlier
    hook, or the marker), instead of being overwritten by the stand-in's. Returns whether all of ``target`` was
    written (then it needs no check later: nothing writes the marker back).
    """
    mask = unwritten_mask(source)
    with torch.no_grad():
        if mask is None or not bool(mask.any()):
            target.copy_(source)
            return True
        target.copy_(torch.where(mask, target, source))
        return False
