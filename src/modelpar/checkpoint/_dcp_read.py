"""Reading DCP folders rank by rank: ``.metadata`` read once, shards read without collectives.

``torch.distributed.checkpoint.load`` re-reads ``.metadata`` on every call and wraps each call in three
collectives (gather every rank's read plan on rank 0, scatter the plans back, gather the outcome). With
DCP's default load planner the plans come back unchanged (``create_default_global_load_plan`` returns them
as they are): each rank finds, from the metadata alone, the pieces of the saved shards that overlap its own
tensors. So every rank reads on its own here (``no_dist=True``), into one state holding everything to load,
and callers that need all ranks to agree on the outcome exchange it once (see :mod:`modelpar.checkpoint._io`).
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future
from typing_extensions import override

from modelpar.checkpoint._remote import RemotePath, dcp_reader_storage
from modelpar.checkpoint._safe_pickle import check_bytes, load_metadata

__all__ = ["CachedReader", "read_local", "root_cause", "single_process"]


class CachedReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` that reads ``.metadata`` once, however often DCP asks for it, and safely.

    Pass ``metadata`` if it was read already; otherwise the first ``read_metadata()`` reads it (and raises
    what DCP raises for a missing or damaged file). ``weights_only`` true or ``None`` (torch's default, true):
    ``.metadata`` and the non-tensor entries are unpickled admitting only what DCP writes there, and anything
    else raises :class:`~modelpar._errors.WeightsOnlyError` (see :mod:`modelpar.checkpoint._safe_pickle`);
    ``False``: read as DCP reads them, with plain ``pickle.load`` and ``torch.load(weights_only=False)``.
    """

    def __init__(
        self, path: Path | RemotePath, metadata: Metadata | None = None, *, weights_only: bool | None = True
    ) -> None:
        super().__init__(str(path) if isinstance(path, RemotePath) else path)
        if isinstance(path, RemotePath):  # DCP's fsspec adapter in place of the local one, as FsspecReader does
            self.fs, self.path = dcp_reader_storage(path)
        self._metadata = metadata
        self._safe = weights_only is not False

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = (
                self._read_metadata_safely(**kwargs) if self._safe else super().read_metadata(*args, **kwargs)
            )
        return self._metadata

    def _read_metadata_safely(self, **kwargs: Any) -> Metadata:
        # FileSystemReader.read_metadata with the restricted unpickler in place of pickle.load.
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as file:
            metadata = load_metadata(cast(IO[bytes], file), str(path))
        if not isinstance(metadata, Metadata):
            raise TypeError(f"The file {str(path)!r} holds a {type(metadata).__name__}, not DCP's `Metadata`.")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata

    @override
    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._safe:  # the planner unpickles byte entries with weights_only=False: check them first
            planner = cast(LoadPlanner, _CheckedBytes(planner, self))
        return super().read_data(plan, planner)


class _CheckedBytes:
    """Stands in for DCP's load planner in ``read_data``, checking each byte entry before the planner loads it.

    ``FileSystemReader.read_data`` hands byte entries to ``planner.load_bytes``, whose ``torch.load`` runs with
    ``weights_only=False``; this is the narrowest place to intercept them for any planner. The check
    unpickles the (small) value once more, with torch's safe loader.
    """

    def __init__(self, planner: LoadPlanner, reader: CachedReader) -> None:
        self._planner = planner
        self._reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        info = self._reader.storage_data.get(read_item.storage_index)
        shard = f"{self._reader.path}/{getattr(info, 'relative_path', '')}"
        check_bytes(value, f"{read_item.dest_index.fqn!r} in {shard!r}")
        self._planner.load_bytes(read_item, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._planner, name)


@contextmanager
def single_process() -> Iterator[None]:
    # DCP warns on every call made without collectives; here that is the point, not a mistake.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def read_local(state: dict[str, Any], reader: CachedReader, *, partial: bool) -> None:
    """Fill ``state`` in place from the reader's folder, on this rank alone (no collectives).

    ``partial``: entries of ``state`` missing from the checkpoint are left as they are instead of raising.
    Errors come as DCP raises them (a ``CheckpointException``, a ``BaseException``); see :func:`root_cause`.
    """
    with single_process():
        dcp.load(state, storage_reader=reader, planner=dcp.DefaultLoadPlanner(allow_partial_load=partial), no_dist=True)


def root_cause(err: BaseException) -> BaseException:
    """The exception inside DCP's ``CheckpointException`` (which holds ``{rank: (exception, traceback)}``)."""
    if isinstance(err, dcp.CheckpointException) and len(err.args) > 1 and isinstance(err.args[1], dict):
        for failure in err.args[1].values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return inner
    return err
