"""Writing a checkpoint's shards over the files of the previous one, in place, not truncated first.

A save to the same path again and again (``last.ckpt``) writes into the checkpoint the previous commit set
aside (see :func:`modelpar.checkpoint._commit.reuse_as_staging`), whose shard files have the same names and,
within a run, about the same sizes. DCP's ``FileSystemWriter`` opens each with ``"wb"``, which truncates it:
the file system frees every block, then allocates new ones while writing, and the ``fsync`` that follows
waits for all that metadata too. Opening the old file for update instead and writing over its blocks moves the
same bytes without freeing or allocating anything: measured on ext4 (4 processes, 100 MiB each, write +
``fsync``), 0.15 s against 0.27 s. If the new content is shorter, the old tail is cut off and that is
``fsync``-ed too, before the stream is closed, so every shard is durable and exact-sized before DCP's
closing gather, as with DCP's own streams (the commit's durability order does not change).

The full format's one file is written over the same way (:func:`open_over`). A path that is a symbolic link,
or anything but a regular file, is opened as DCP would (``"wb"``).
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Generator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = ["InPlaceFileSystem", "local_writer", "open_over"]


class _ExactSizeStream(io.BufferedRandom):
    """A file opened for update whose ``close`` cuts off what lies past the last byte written, durably."""

    _end = 0  # the furthest byte written: a writer may seek back to fill in a header

    def write(self, data: Any) -> int:
        written = super().write(data)
        self._end = max(self._end, self.tell())
        return written

    def close(self) -> None:
        if not self.closed:
            try:
                if os.fstat(self.fileno()).st_size > self._end:
                    self.truncate(self._end)
                    os.fsync(self.fileno())
            finally:
                super().close()


@contextmanager
def open_over(path: Path) -> Generator[io.BufferedRandom | io.BufferedWriter, None, None]:
    """Open ``path`` to write it from its first byte: in place if it is a regular file already, else created.

    When the stream closes, the file ends at the last byte written (cut off, and that ``fsync``-ed, if the old
    content was longer), whether or not the caller closed it first.
    """
    if not _regular_file(path):
        with open(path, "wb") as created:
            yield created
        return
    with _ExactSizeStream(io.FileIO(os.fspath(path), "r+")) as stream:
        yield stream


class InPlaceFileSystem(FileSystem):
    """DCP's local file system, except that a write to an existing regular file overwrites it in place."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with open_over(Path(path)) as stream:
            yield stream


def _regular_file(path: Path) -> bool:
    """Whether ``path`` itself (not what a link points to) is a regular file."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def local_writer(path: Path, **options: Any) -> FileSystemWriter:
    """DCP's ``FileSystemWriter`` for ``path`` (``options`` passed on), writing over existing shards in place."""
    writer = FileSystemWriter(path, **options)
    if isinstance(getattr(writer, "fs", None), FileSystem):  # where DCP keeps its file system; else left as is
        writer.fs = InPlaceFileSystem()
    return writer
