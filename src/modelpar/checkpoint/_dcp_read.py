"""Reading DCP folders rank by rank: ``.metadata`` read once, shards read without collectives.

``torch.distributed.checkpoint.load`` re-reads ``.metadata`` on every call and wraps each call in three
collectives (gather every rank's read plan on rank 0, scatter the plans back, gather the outcome). With
DCP's default load planner the plans come back unchanged (``create_default_global_load_plan`` returns them
as they are): each rank finds, from the metadata alone, the pieces of the saved shards that overlap its own
tensors. So every rank reads on its own here (``no_dist=True``), into one state holding everything to load,
and callers that need all ranks to agree on the outcome exchange it once (see :mod:`modelpar.checkpoint._io`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata
from typing_extensions import override

__all__ = ["CachedReader", "read_local", "root_cause", "single_process"]


class CachedReader(dcp.FileSystemReader):
    """A ``FileSystemReader`` that reads ``.metadata`` once, however often DCP asks for it.

    Pass ``metadata`` if it was read already; otherwise the first ``read_metadata()`` reads it (and raises
    what DCP raises for a missing or damaged file).
    """

    def __init__(self, path: Path, metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    @override
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


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
