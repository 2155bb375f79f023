"""Checkpoints at fsspec URLs (``s3://``, ``gs://``, ``az://``, ``hf://`` ...): the path type and the commit.

Object stores have no rename, so the local commit (write beside the target, then rename into place: see
:mod:`modelpar.checkpoint._commit`) cannot work there. A distributed checkpoint at a URL is written under its
final prefix instead, between two small marker objects:

1. rank 0 writes ``.modelpar-writing`` first, then removes what an earlier checkpoint left under the prefix
   (its commit marker first), then ``meta.pt``;
2. every rank uploads its shards; DCP's ``.metadata`` follows once all of them are written;
3. rank 0 writes ``.modelpar-complete`` (the commit), then removes ``.modelpar-writing``.

A reader takes a prefix holding ``.modelpar-complete`` for a checkpoint and one holding ``.modelpar-writing``
without it for an interrupted save, which it reports as absent. A prefix with neither but with DCP's
``.metadata`` was written by another tool (Lightning's strategy, ``torch.distributed.checkpoint``), whose own
``.metadata`` comes last, and loads. A full checkpoint is one object: object stores make an upload visible
only once complete (a killed multipart upload never appears), so it needs no marker.

``file://`` URLs are local paths, and take the local code path (atomic renames, fsync) unchanged.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

import torch

from modelpar.checkpoint._format import COMMIT_MARKER, DCP_METADATA, WRITING_MARKER

__all__ = [
    "COMMIT_MARKER",
    "WRITING_MARKER",
    "Location",
    "RemotePath",
    "commit_prefix",
    "dcp_reader_storage",
    "dcp_writer",
    "fsspec_storage",
    "local_copy",
    "prefix_state",
    "prepare_prefix",
    "staged_upload",
    "to_location",
    "torch_load_remote",
    "upload",
    "upload_file",
    "withdraw",
]


# fsspec protocol -> (the package implementing it, modelpar's extra that installs it)
_IMPLEMENTATIONS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"),
    "abfs": ("adlfs", "azure"),
    "abfss": ("adlfs", "azure"),
    "hf": ("huggingface_hub", "hf"),
}
_LOCAL = ("file", "local")


class RemotePath:
    """A URL on an fsspec file system, with the slice of :class:`pathlib.Path` the checkpoint code uses.

    ``str()`` is the URL, so messages and broadcasts carry it whole (``Path`` would fold ``s3://`` into
    ``s3:/``). Existence checks drop the file system's listing cache first: another process may have just
    written or removed the object.
    """

    def __init__(self, url: str, fs: Any, storage_options: Mapping[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.fs = fs
        self.storage_options = dict(storage_options or {})
        self.fs_path: str = fs._strip_protocol(self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self.fs, self.storage_options)

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    def _info(self) -> dict[str, Any] | None:
        self.fs.invalidate_cache(self.fs_path)
        try:
            return dict(self.fs.info(self.fs_path))
        except FileNotFoundError:
            return None

    def exists(self) -> bool:
        return self._info() is not None

    def is_file(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "file"

    def is_dir(self) -> bool:
        info = self._info()
        return info is not None and info.get("type") == "directory"

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> list[RemotePath]:
        self.fs.invalidate_cache(self.fs_path)
        try:
            names = self.fs.ls(self.fs_path, detail=False)
        except FileNotFoundError:
            return []
        return [self / str(name).rstrip("/").rsplit("/", 1)[-1] for name in names]

    def read_bytes(self) -> bytes:
        return bytes(self.fs.cat_file(self.fs_path))

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.fs_path, data)

    def remove(self) -> None:
        """Delete the object, or everything under the prefix; absent is fine."""
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.fs_path, recursive=True)
        self.fs.invalidate_cache(self.fs_path)


Location = Path | RemotePath


def to_location(
    path: str | os.PathLike[str] | RemotePath, storage_options: Mapping[str, Any] | None = None
) -> Location:
    """A local :class:`~pathlib.Path`, or a :class:`RemotePath` for a URL of an fsspec file system.

    ``storage_options`` go to the file system (credentials, endpoint ...); without them fsspec reads the file
    system's own configuration (for S3: the ``AWS_*`` environment variables and ``~/.aws``). A protocol whose
    implementation is not installed raises ``ImportError`` naming modelpar's extra that installs it.
    """
    if isinstance(path, (RemotePath, Path)):
        return path
    text = os.fspath(path)
    if "://" not in text:
        return Path(text)
    protocol = text.split("://", 1)[0].lower()
    if protocol in _LOCAL:
        return Path(text.split("://", 1)[1])
    try:
        from fsspec.core import url_to_fs
    except ImportError as err:  # pragma: no cover - fsspec comes with torch's checkpoint stack
        raise ImportError(f"Checkpoints at URLs like {text!r} need fsspec: `pip install fsspec`.") from err
    try:
        fs, _ = url_to_fs(text, **dict(storage_options or {}))
    except ImportError as err:
        package, extra = _IMPLEMENTATIONS.get(protocol, (None, None))
        hint = (
            f"`pip install 'modelpar[{extra}]'` (or `pip install {package}`)"
            if package
            else "the fsspec implementation of that protocol"
        )
        raise ImportError(f"Checkpoints at {protocol}:// URLs such as {text!r} need {hint}.") from err
    except ValueError as err:
        raise ValueError(
            f"{text!r} is not a URL fsspec knows ({err}). Use a local path, or a URL of an installed fsspec file"
            " system (s3://, gs://, az://, hf:// ...)."
        ) from err
    return RemotePath(text, fs, storage_options)


def dcp_writer(target: RemotePath) -> Any:
    """DCP's fsspec writer for ``target``, the one ``torch.distributed.checkpoint.save`` picks for a URL.

    ``sync_files=False``: closing an object completes its upload, which is what makes it durable; with
    ``True`` DCP would fall back to ``os.sync()`` (flushing the whole local machine) for every shard.
    """
    # DCP's own choice for URL checkpoint ids (``_storage_utils``).
    return fsspec_storage().FsspecWriter(target.url, sync_files=False, overwrite=True, **target.storage_options)


def dcp_reader_storage(target: RemotePath) -> tuple[Any, Any]:
    """(DCP's fsspec file-system adapter, the path it reads) for a reader of ``target``: what ``FsspecReader``
    reads through (its adapter class is private in every release)."""
    reader = fsspec_storage().FsspecReader(target.url, **target.storage_options)
    return reader.fs, reader.path


def fsspec_storage() -> ModuleType:
    """DCP's fsspec storage module, whose ``FsspecWriter`` and ``FsspecReader`` are public.

    torch 2.15 made the module public (``torch.distributed.checkpoint.fsspec_filesystem``) and turned the private
    ``_fsspec_filesystem`` into an alias that warns, on import, that it will be removed; torch 2.11 to 2.14 have
    only the private one. The public module where it exists, then, and the private one only where nothing else is.
    """
    public = "torch.distributed.checkpoint.fsspec_filesystem"
    try:
        return importlib.import_module(public)
    except ModuleNotFoundError as err:
        if err.name != public:  # fsspec itself missing: the private module would raise the same
            raise
        return importlib.import_module("torch.distributed.checkpoint._fsspec_filesystem")


def _marker(token: str) -> bytes:
    return json.dumps({"token": token, "time": time.time()}).encode()


def prepare_prefix(target: RemotePath, token: str) -> None:
    """Rank 0, before a distributed save to ``target``: mark it as being written, then clear what was there.

    The writing marker goes first, so that from then on a reader sees an interrupted save, never a mix of the
    old checkpoint and the new one; the old commit marker goes next, then the rest.
    """
    if target.is_file():
        target.remove()  # a full checkpoint at the same URL is replaced by the folder
    (target / WRITING_MARKER).write_bytes(_marker(token))
    (target / COMMIT_MARKER).remove()
    for entry in target.iterdir():
        if entry.name != WRITING_MARKER:
            entry.remove()


def commit_prefix(target: RemotePath, token: str) -> None:
    """Rank 0, once every rank's shards and DCP's ``.metadata`` are written: make the checkpoint visible."""
    (target / COMMIT_MARKER).write_bytes(_marker(token))
    (target / WRITING_MARKER).remove()


def withdraw(target: RemotePath) -> None:
    """Delete the checkpoint at ``target`` so that no reader ever takes what is left of it for complete."""
    if target.is_dir():
        prepare_prefix(target, "withdrawn")  # the order of a new save: from now on it reads as interrupted
    target.remove()
    if target.exists():  # servers with real folders (SeaweedFS) keep the emptied folder, listed as an entry, once
        target.remove()


def prefix_state(target: RemotePath) -> str:
    """What the prefix ``target`` holds, by the rule in this module's docstring: ``"complete"`` (the commit
    marker), ``"partial"`` (the writing marker alone: a save under way or interrupted), ``"foreign"`` (no marker,
    but DCP's ``.metadata``: complete, written by another tool) or ``"none"`` (not a checkpoint)."""
    names = {entry.name for entry in target.iterdir()}
    if COMMIT_MARKER in names:
        return "complete"
    if WRITING_MARKER in names:
        return "partial"
    return "foreign" if DCP_METADATA in names else "none"


def upload_file(target: RemotePath, write: Any) -> None:
    """Stream ``write(file)`` into the object ``target``; it appears only if ``write`` returns.

    On an error the upload is discarded (a multipart upload aborted), not completed: fsspec's context manager
    would complete it, publishing a truncated object in place of the previous one.
    """
    stale = target.is_dir()  # a distributed checkpoint at the same URL: replaced by the file once it is complete
    file: BinaryIO = target.fs.open(target.fs_path, "wb")
    try:
        write(file)
    except BaseException:
        discard = getattr(file, "discard", None)
        if callable(discard):
            discard()  # s3fs aborts the multipart upload, gcsfs the resumable one
        with contextlib.suppress(AttributeError):
            file.closed = True  # type: ignore[misc]  # or closing it (on collection) would complete the upload
        raise
    file.close()
    if stale:
        for entry in target.iterdir():
            entry.remove()


def torch_load_remote(target: RemotePath, weights_only: bool | None) -> Any:
    """``torch.load`` of the object ``target``, read whole into memory (no memory map over a network)."""
    return torch.load(io.BytesIO(target.read_bytes()), map_location="cpu", weights_only=weights_only)


@contextlib.contextmanager
def local_copy(source: Location) -> Iterator[Path]:
    """A local path holding ``source``: itself if local, else a download into a temporary folder (removed after).

    For the offline tools (convert, export), whose readers need random access to whole files.
    """
    if isinstance(source, Path):
        yield source
        return
    with tempfile.TemporaryDirectory(prefix="modelpar-download-") as tmp:
        local = Path(tmp) / (source.name or "checkpoint")
        if source.is_dir():
            source.fs.get(source.fs_path + "/", str(local) + "/", recursive=True)
        else:
            source.fs.get_file(source.fs_path, str(local))
        yield local


@contextlib.contextmanager
def staged_upload(target: Location, *, markers: bool = True) -> Iterator[Path]:
    """A local path to write ``target`` into: itself if local; for a URL, a temporary one uploaded on success.

    A folder is uploaded under the commit protocol (``markers``: the markers around its files), or, for a
    Hugging Face folder, with ``config.json`` last, so that an interrupted upload does not load; a file as one
    object.
    """
    if isinstance(target, Path):
        yield target
        return
    with tempfile.TemporaryDirectory(prefix="modelpar-upload-") as tmp:
        local = Path(tmp) / (target.name or "checkpoint")
        yield local
        upload(local, target, markers=markers)


def upload(local: Path, target: RemotePath, *, markers: bool = True) -> None:
    """Upload the local file or folder ``local`` to ``target`` (see :func:`staged_upload`)."""
    if local.is_file():

        def copy(file: BinaryIO) -> None:
            with local.open("rb") as src:
                shutil.copyfileobj(src, file, 8 << 20)

        upload_file(target, copy)
        return
    token = os.urandom(6).hex()
    if markers:
        prepare_prefix(target, token)
    files = sorted((entry for entry in local.rglob("*") if entry.is_file()), key=lambda e: e.name == "config.json")
    for entry in files:
        target.fs.put_file(str(entry), f"{target.fs_path}/{entry.relative_to(local).as_posix()}")
    if markers:
        commit_prefix(target, token)
