"""What a checkpoint holds, read without loading its tensors: :func:`describe_checkpoint`, and the readers
that offline conversion shares with it.

A distributed folder is described from DCP's ``.metadata`` alone (shapes and dtypes, no shard reads) plus the
small ``meta.pt``; a full file is memory-mapped, so listing it touches no tensor data either.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from modelpar._errors import CorruptCheckpointError, WeightsOnlyError
from modelpar.checkpoint._dcp_read import CachedReader
from modelpar.checkpoint._format import DCP_METADATA, USER_METADATA, CheckpointFormat
from modelpar.checkpoint._io import detect, read_full_checkpoint
from modelpar.checkpoint._remote import Location, to_location

__all__ = [
    "describe_checkpoint",
    "format_size",
    "is_state_entry",
    "iter_tensors",
    "read_dcp_metadata",
    "read_user_metadata",
]


def format_size(nbytes: int) -> str:
    """``nbytes`` in binary units, e.g. ``"1.5 MiB"``."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size = nbytes / 1024
    for unit in ("KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def iter_tensors(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor inside nested dicts, lists and tuples, keyed by its dotted path (as DCP flattens keys)."""
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from iter_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from iter_tensors(item, f"{prefix}.{index}" if prefix else str(index))


def is_state_entry(value: Any) -> bool:
    """Whether a top-level entry of a full file is a model or optimizer state dict (the rest is metadata).

    Models: a flat mapping from parameter names to tensors. Optimizers: a mapping with ``"state"`` and
    ``"param_groups"``. A flat dict of tensors saved as metadata (say, RNG states) looks like a model: the full
    format does not record the difference.
    """
    if not isinstance(value, Mapping):
        return False
    if "state" in value and "param_groups" in value:
        return True
    values = list(value.values())
    flat = not any(isinstance(v, (Mapping, list, tuple)) for v in values)
    return flat and any(isinstance(v, torch.Tensor) for v in values)


def read_dcp_metadata(folder: Location, *, weights_only: bool | None = None) -> Metadata:
    """DCP's ``.metadata`` of ``folder``: per flattened key its shape and dtype, and its nested path.

    ``weights_only`` true or ``None`` (torch's default): unpickled admitting only what DCP writes there.
    """
    try:
        return CachedReader(folder, weights_only=weights_only).read_metadata()
    except WeightsOnlyError:
        raise
    except Exception as err:  # a pickle of DCP classes: anything can go wrong with a damaged file
        raise CorruptCheckpointError(
            f"The checkpoint {str(folder)!r} has an unreadable {DCP_METADATA!r} file ({type(err).__name__}: {err})."
        ) from err


def read_user_metadata(folder: Location, *, weights_only: bool | None = None) -> dict[str, Any]:
    """The non-tensor state a distributed checkpoint keeps in ``meta.pt`` (``{}`` if the file is absent)."""
    meta_path = folder / USER_METADATA
    if not meta_path.is_file():
        return {}
    return read_full_checkpoint(meta_path, weights_only)


def _table(rows: list[tuple[str, str, str, str]]) -> list[str]:
    header = ("key", "shape", "dtype", "size")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    return [f"  {r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:<{widths[2]}}  {r[3]:>10}" for r in [header, *rows]]


def _row(key: str, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> tuple[str, str, str, str]:
    return key, str(list(shape)), str(dtype).removeprefix("torch."), format_size(nbytes)


def describe_checkpoint(path: str | os.PathLike[str] | Location, *, weights_only: bool | None = None) -> str:
    """A human-readable listing: the format, one line per tensor (key, shape, dtype, size), totals, metadata keys.

    Meant for a quick look before converting or loading (``modelpar inspect PATH``); reads no tensor data.
    ``weights_only`` as in :func:`~modelpar.checkpoint.load_state`: pass ``False`` only for checkpoints you trust.
    """
    path = to_location(path)
    fmt = detect(path)
    rows: list[tuple[str, str, str, str]] = []
    total = 0
    others: list[str] = []
    if fmt is CheckpointFormat.DISTRIBUTED:
        for key, item in read_dcp_metadata(path, weights_only=weights_only).state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata):
                dtype = item.properties.dtype
                nbytes = item.size.numel() * dtype.itemsize
                rows.append(_row(key, tuple(item.size), dtype, nbytes))
                total += nbytes
            else:
                others.append(key)
        metadata = list(read_user_metadata(path, weights_only=weights_only))
    else:
        checkpoint = read_full_checkpoint(path, weights_only)
        metadata = [key for key, value in checkpoint.items() if not is_state_entry(value)]
        for key, tensor in iter_tensors(checkpoint, ""):
            nbytes = tensor.numel() * tensor.element_size()
            rows.append(_row(key, tuple(tensor.shape), tensor.dtype, nbytes))
            total += nbytes
    lines = [f"format: {fmt.value} ({str(path)!r})"]
    if rows:
        lines += _table(rows)
    lines.append(f"total: {len(rows)} tensors, {format_size(total)}")
    if others:
        lines.append(f"non-tensor entries: {len(others)} (e.g. {', '.join(others[:3])})")
    lines.append(f"metadata: {', '.join(metadata) if metadata else '(none)'}")
    return "\n".join(lines)
