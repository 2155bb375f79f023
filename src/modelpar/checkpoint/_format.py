"""Telling checkpoint formats apart, and the file names shared with Lightning's strategy.

Same names as Lightning's ``ModelParallelStrategy`` (DCP's ``.metadata`` plus ``meta.pt``), so folders move
both ways between the two strategies.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["DCP_METADATA", "USER_METADATA", "CheckpointFormat"]

DCP_METADATA = ".metadata"
USER_METADATA = "meta.pt"


class CheckpointFormat(str, Enum):
    DISTRIBUTED = "distributed"
    FULL = "full"
