"""Telling checkpoint formats apart, and the file names shared with Lightning's strategy.

Same names as Lightning's ``ModelParallelStrategy`` (DCP's ``.metadata`` plus ``meta.pt``), so folders move
both ways between the two strategies.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

__all__ = ["DCP_METADATA", "USER_METADATA", "CheckpointFormat", "detect_format"]

DCP_METADATA = ".metadata"
USER_METADATA = "meta.pt"


class CheckpointFormat(str, Enum):
    DISTRIBUTED = "distributed"
    FULL = "full"


def detect_format(path: Path) -> CheckpointFormat:
    """The format at ``path``, or a ``FileNotFoundError``/``ValueError`` that names the path and what was expected."""
    if path.is_file():
        return CheckpointFormat.FULL
    if path.is_dir():
        if (path / DCP_METADATA).is_file():
            return CheckpointFormat.DISTRIBUTED
        raise ValueError(
            f"The folder {str(path)!r} is not a distributed checkpoint: it has no {DCP_METADATA!r} file. Point to"
            " a folder written by `save_checkpoint` (or torch.distributed.checkpoint), or to a single-file"
            " checkpoint."
        )
    raise FileNotFoundError(f"No checkpoint at {str(path)!r}: the path does not exist.")
