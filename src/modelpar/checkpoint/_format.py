"""Telling checkpoint formats apart, and the file names shared with Lightning's strategy.

Same names as Lightning's ``ModelParallelStrategy`` (DCP's ``.metadata`` plus ``meta.pt``), so folders move
both ways between the two strategies.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

__all__ = [
    "COMMIT_MARKER",
    "DCP_METADATA",
    "SHARD_SUFFIX",
    "WRITING_MARKER",
    "USER_METADATA",
    "CheckpointFormat",
    "foreign_entries",
    "replaceable_folder",
]

DCP_METADATA = ".metadata"
USER_METADATA = "meta.pt"
COMMIT_MARKER = ".modelpar-complete"  # at URLs, where nothing can be renamed: see modelpar.checkpoint._remote
WRITING_MARKER = ".modelpar-writing"
SHARD_SUFFIX = ".distcp"  # DCP's FileSystemWriter names each rank's files ``__<rank>_<n>.distcp``


class CheckpointFormat(str, Enum):
    DISTRIBUTED = "distributed"
    FULL = "full"


def _ours(name: str) -> bool:
    return name in (DCP_METADATA, USER_METADATA, COMMIT_MARKER, WRITING_MARKER) or name.endswith(SHARD_SUFFIX)


def foreign_entries(path: Any) -> list[str]:
    """The names in the folder ``path`` that no checkpoint writes: the user's files, which a save keeps."""
    return sorted(entry.name for entry in path.iterdir() if not _ours(entry.name))


def replaceable_folder(path: Any) -> bool:
    """Whether a save may replace the folder ``path``: it is empty, or a checkpoint folder.

    A checkpoint folder in DCP's, Lightning's or our layout: it holds DCP's ``.metadata``, Lightning's
    ``meta.pt`` (what Lightning 2.6.6 takes for a checkpoint), DCP shards (a save that did not finish), or, at a
    URL, the markers of :mod:`modelpar.checkpoint._remote`. ``path``: a ``Path`` or a ``RemotePath``.
    Lightning creates the folder before writing into it, so an empty one, or one holding only ``meta.pt``,
    is what an interrupted Lightning save or a user's ``mkdir`` leaves. Anything else holds the user's files.
    """
    names = [entry.name for entry in path.iterdir()]
    return not names or any(map(_ours, names))
