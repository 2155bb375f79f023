"""Atomic commit: a checkpoint appears at its path only once it is complete.

Every save writes into a staging entry beside the target, ``.<name>.partial-<token>`` (a folder for the
distributed format, a file for the full one). Only when everything is written does rank 0 move the old
checkpoint aside (``.<name>.old-<token>``), rename the staging entry to the target, and delete the old one.
Renames within a folder are atomic, so a crash or kill at any point leaves either the previous checkpoint
or the new one at the path, never a mix. The leftovers of an interrupted save are recognised by name: load
reports them, and the next save to the same path removes them.

A power loss is harsher than a kill: the file system may have persisted a rename but not the data renamed.
So the commit is ordered for durability: ``fsync`` every file in the staging entry and every folder in it
(DCP's shards, ``.metadata``, ``meta.pt``, or the one full file), rename, ``fsync`` the parent folder, and
only then delete the previous checkpoint.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

__all__ = ["commit", "describe_leftovers", "new_token", "remove_stale", "staging_path"]

_PARTIAL = ".partial-"
_OLD = ".old-"


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def staging_path(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}{_PARTIAL}{token}"


def _aside_path(path: Path, token: str) -> Path:
    return path.parent / f".{path.name}{_OLD}{token}"


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    elif entry.exists() or entry.is_symlink():
        entry.unlink(missing_ok=True)


def _leftovers(path: Path, marker: str) -> list[Path]:
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f".{path.name}{marker}*"))


def remove_stale(path: Path, keep_token: str | None = None) -> None:
    """Delete what interrupted saves to ``path`` left behind, before a new save (by one process per node).

    ``keep_token``: the save in progress, whose staging entry and, during its commit, whose previous
    checkpoint set aside are kept.
    """
    for entry in _leftovers(path, _PARTIAL):
        if keep_token is None or not entry.name.endswith(keep_token):
            _remove(entry)
    if path.exists():  # an ".old" entry only matters while the path itself is missing
        for entry in _leftovers(path, _OLD):
            if keep_token is None or not entry.name.endswith(keep_token):
                _remove(entry)


def commit(path: Path, staged: Path, token: str) -> None:
    """Replace whatever is at ``path`` (file or folder) with ``staged``, durably (rank 0 only).

    Order: ``fsync`` everything in ``staged``, rename, ``fsync`` the parent folder, delete the old one. At no
    point can a power loss leave the path without a complete checkpoint, the new one or the old one.
    """
    _sync_tree(staged)
    aside = _aside_path(path, token)
    had_previous = path.exists() or path.is_symlink()
    if had_previous:
        os.replace(path, aside)
    os.replace(staged, path)
    _fsync(path.parent, folder=True)
    if had_previous:
        _remove(aside)


def _sync_tree(entry: Path) -> None:
    """``fsync`` a staged file, or every file and folder in a staged folder (folders after their content)."""
    if not entry.is_dir() or entry.is_symlink():
        _fsync(entry, folder=False)
        return
    for root, folders, files in os.walk(entry, topdown=False):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                _fsync(Path(root, name), folder=False)
        for name in folders:  # os.walk does not descend into links, and lists them here
            if not os.path.islink(os.path.join(root, name)):
                _fsync(Path(root, name), folder=True)
    _fsync(entry, folder=True)


# fsync refused because the file system or platform does not support it here: nothing more can be done.
_UNSUPPORTED = {errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP}


def _fsync(entry: Path, *, folder: bool) -> None:
    """Flush ``entry`` to stable storage; a real I/O error is raised, so a save that is not durable fails."""
    # Windows flushes only handles open for writing, and cannot open folders at all.
    flags = os.O_RDWR if os.name == "nt" and not folder else os.O_RDONLY
    try:
        fd = os.open(entry, flags)
    except OSError:
        if folder:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in _UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def describe_leftovers(path: Path) -> str:
    """A sentence about interrupted saves to ``path``, or ``""`` if there are none (for error messages)."""
    partial = _leftovers(path, _PARTIAL)
    old = _leftovers(path, _OLD) if not path.exists() else []
    notes = []
    if old:
        notes.append(
            f" A save was interrupted while replacing it: the previous checkpoint is intact at {str(old[-1])!r};"
            " rename it back to use it."
        )
    if partial:
        notes.append(
            f" An incomplete save (interrupted before it finished) is at {str(partial[-1])!r}; it cannot be"
            " loaded and the next save to this path removes it."
        )
    return "".join(notes)
