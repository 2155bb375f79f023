"""Atomic commit: a checkpoint appears at its path only once it is complete.

Every save writes into a staging entry beside the target, ``.<name>.partial-<token>`` (a folder for the
distributed format, a file for the full one). Only when everything is written does rank 0 move the old
checkpoint aside (``.<name>.old-<token>``) and rename the staging entry to the target. Renames within a
folder are atomic, so a crash or kill at any point leaves either the previous checkpoint or the new one at
the path, never a mix (a folder that also holds the user's files is the exception: see :func:`commit_among`).
The old checkpoint set aside is not deleted inside the commit, where every rank would
wait: the next save to the same path writes over it (:func:`reuse_as_staging`), or a :class:`Trash` deletes
it in the background. The leftovers of an interrupted save or deletion are recognised by name: load
reports them, and the next save to the same path removes them.

A power loss is harsher than a kill: the file system may have persisted a rename but not the data renamed.
So the commit is ordered for durability: every file written is ``fsync``-ed before the rename, by the
process that wrote it (each rank's DCP writer its own shards, right after writing them, before DCP's closing
gather of the ranks' results, which is the barrier; on Lustre or GPFS an ``fsync`` from another client would
not flush the writer's pages), then rank 0 ``fsync``-s the rest of the staging entry (DCP's ``.metadata``,
``meta.pt``, the one full file) and its folders, renames, ``fsync``-s the parent folder, and only then lets the
previous checkpoint go.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import uuid
from collections.abc import Callable, Collection
from pathlib import Path

from modelpar.checkpoint._format import DCP_METADATA, SHARD_SUFFIX, USER_METADATA, foreign_entries

__all__ = [
    "Trash",
    "commit",
    "commit_among",
    "describe_leftovers",
    "new_token",
    "remove_stale",
    "reuse_as_staging",
    "staging_path",
]

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


def remove_stale(path: Path, keep_token: str | None = None, *, busy: Collection[Path] = ()) -> None:
    """Delete what interrupted saves to ``path`` left behind, before a new save (by one process per node).

    ``keep_token``: the save in progress, whose staging entry and, during its commit, whose previous
    checkpoint set aside are kept. ``busy``: old checkpoints a :class:`Trash` is deleting right now.
    """
    for entry in _leftovers(path, _PARTIAL):
        if keep_token is None or not entry.name.endswith(keep_token):
            _remove(entry)
    if path.exists():  # an ".old" entry only matters while the path itself is missing
        for entry in _leftovers(path, _OLD):
            if (keep_token is None or not entry.name.endswith(keep_token)) and entry not in busy:
                _remove(entry)


def commit(
    path: Path,
    staged: Path,
    token: str,
    *,
    shards_synced: bool = False,
    discard: Callable[[Path], None] | None = None,
) -> None:
    """Replace whatever is at ``path`` (file or folder) with ``staged``, durably (rank 0 only).

    Order: ``fsync`` everything in ``staged``, rename, ``fsync`` the parent folder, let the old one go. At no
    point can a power loss leave the path without a complete checkpoint, the new one or the old one.
    ``shards_synced``: every rank has made its own DCP shards durable already (DCP's ``FileSystemWriter`` with
    ``sync_files=True``, before the gather that ends the write), so they are not ``fsync``-ed again here.
    ``discard``: what becomes of the previous checkpoint, set aside under a name that the next save removes
    (a :class:`Trash` deletes it in the background); by default it is deleted before this returns.
    """
    _sync_tree(staged, skip_shards=shards_synced)
    aside = _aside_path(path, token)
    had_previous = path.exists() or path.is_symlink()
    if had_previous:
        os.replace(path, aside)
    os.replace(staged, path)
    _fsync(path.parent, folder=True)
    if had_previous:
        (discard or _remove)(aside)


def commit_among(path: Path, staged: Path, *, shards_synced: bool = False) -> None:
    """Move the staged checkpoint folder's files into the folder ``path``, which holds files of the user's too,
    keeping those (rank 0 only).

    Lightning's strategy writes a distributed checkpoint into an existing folder and leaves what else is there;
    replacing the folder as :func:`commit` does would delete the user's files. The order keeps a folder that
    loads from ever mixing two checkpoints: the previous checkpoint's ``.metadata`` goes first (from then on the
    folder is an incomplete checkpoint, which load reports as such), then the new files come in and the previous
    checkpoint's other files go, and the new ``.metadata``, which completes the checkpoint, comes last; each
    step is made durable before the next. So a crash in between leaves an incomplete checkpoint there, not the
    previous one: a checkpoint saved to a path of its own keeps the previous one instead.
    """
    _sync_tree(staged, skip_shards=shards_synced)
    (path / DCP_METADATA).unlink(missing_ok=True)
    _fsync(path, folder=True)
    new = {entry.name for entry in staged.iterdir()}
    keep = set(foreign_entries(path)) | new
    for name in sorted(new - {DCP_METADATA}):
        os.replace(staged / name, path / name)
    for entry in path.iterdir():
        if entry.name not in keep:  # the previous checkpoint's files that the new one does not write over
            _remove(entry)
    _fsync(path, folder=True)
    if DCP_METADATA in new:
        os.replace(staged / DCP_METADATA, path / DCP_METADATA)
        _fsync(path, folder=True)
    staged.rmdir()
    _fsync(path.parent, folder=True)


def reuse_as_staging(spare: Path, path: Path, token: str, *, folder: bool) -> bool:
    """Make ``spare``, a previous checkpoint of ``path`` set aside by a commit, the staging entry of a new save.

    The new save then writes over its files, truncating them, as Lightning's strategy writes over its folder,
    instead of writing new files while the old ones are deleted: on a journaling file system each ``fsync``
    of the new files would also wait for the deletion's metadata. The folder's ``.metadata`` and ``meta.pt``
    go first, so that until the new save writes them it is an incomplete checkpoint, never the old one.
    Returns whether ``spare`` was of ``path`` and of the right kind (a folder, or a file) and is now staged.
    """
    of_path = spare.parent == path.parent and spare.name.startswith(f".{path.name}{_OLD}")
    if not of_path or spare.is_symlink() or not (spare.is_dir() if folder else spare.is_file()):
        return False
    if folder:
        for name in (DCP_METADATA, USER_METADATA):
            (spare / name).unlink(missing_ok=True)
    os.replace(spare, staging_path(path, token))
    return True


def _sync_tree(entry: Path, *, skip_shards: bool = False) -> None:
    """``fsync`` a staged file, or every file and folder in a staged folder (folders after their content)."""
    if not entry.is_dir() or entry.is_symlink():
        _fsync(entry, folder=False)
        return
    for root, folders, files in os.walk(entry, topdown=False):
        for name in files:
            if skip_shards and name.endswith(SHARD_SUFFIX):
                continue
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


class Trash:
    """Deletes previous checkpoints set aside by commits in a background thread, off the critical path.

    Deleting a checkpoint of many shard files takes long on some file systems; inside the commit, every rank
    would wait for it. The entry keeps its ``.<name>.old-<token>`` name until it is gone, so a crash while
    deleting leaves only that, which the next save to the path removes (:func:`remove_stale`, told by
    :meth:`busy` which entries are still being deleted here). :meth:`wait` joins the deletions in progress.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[Path] = []
        self._thread: threading.Thread | None = None

    def discard(self, entry: Path) -> None:
        """Delete ``entry`` in the background."""
        with self._lock:
            self._entries.append(entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="modelpar-ckpt-trash", daemon=True)
                self._thread.start()

    def busy(self) -> list[Path]:
        """The entries not yet deleted."""
        with self._lock:
            return list(self._entries)

    def wait(self) -> None:
        """Block until every entry handed to :meth:`discard` is deleted."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._entries:
                    self._thread = None
                    return
                entry = self._entries[0]
            with contextlib.suppress(OSError):  # what is left keeps a name the next save removes
                _remove(entry)
            with self._lock:
                self._entries.pop(0)
