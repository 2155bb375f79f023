"""Where the bytes of a ``torch.save`` file lie, and writing tensors there in place.

:func:`~modelpar.checkpoint.convert_to_file` lets ``torch.save`` lay out a file of the right structure with empty
storages, then streams each tensor into its record: :func:`storage_offsets` pairs the memory-mapped storages with
the zip directory's records (both in file order), :func:`write_at` writes one tensor's bytes, and
:class:`ReusedBuffer` is the one allocation reads and casts go through.
"""

from __future__ import annotations

import io
import re
import struct
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["ReusedBuffer", "storage_offsets", "write_at"]

Path_ = tuple[str | int, ...]


def _data_records(path: Path) -> list[tuple[int, int]]:
    """(offset, size) of every non-empty storage record in a ``torch.save`` zip file, in file order."""
    records = []
    with zipfile.ZipFile(path) as archive, path.open("rb") as file:
        for info in archive.infolist():
            if info.file_size and re.search(r"(^|/)data/\d+$", info.filename):
                file.seek(info.header_offset)
                name_length, extra_length = struct.unpack("<HH", file.read(30)[26:30])
                records.append((info.header_offset + 30 + name_length + extra_length, info.file_size))
    return sorted(records)


def storage_offsets(staged: Path, paths: Sequence[Path_], get: Callable[[Any, Path_], Any]) -> list[int | None]:
    """Where each tensor's bytes go in the laid-out file (``None``: empty, nothing to write); ``get`` finds the tensor
    at a path of the nested state.

    The file memory-mapped (nothing is read) puts each storage at ``base + offset``, and the zip directory
    lists the records' offsets; both in file order, they pair up, and sizes and spacing must agree exactly.
    """
    # weights_only=False: our own file, whose non-tensor values DCP has just unpickled from the same source.
    mapped = torch.load(staged, mmap=True, map_location="cpu", weights_only=False)
    storages = [get(mapped, path).untyped_storage() for path in paths]
    placed = sorted((s.data_ptr(), s.nbytes(), i) for i, s in enumerate(storages) if s.nbytes())
    records = _data_records(staged)
    consistent = len(placed) == len(records) and all(
        size == record_size and ptr - offset == placed[0][0] - records[0][0]
        for (ptr, size, _), (offset, record_size) in zip(placed, records, strict=True)
    )
    if not consistent:
        raise RuntimeError(
            f"The file layout `torch.save` wrote to {str(staged)!r} is not the one expected ({len(records)} records"
            f" for {len(placed)} tensors). Please report this with your torch version ({torch.__version__})."
        )
    offsets: list[int | None] = [None] * len(paths)
    for (_, _, index), (offset, _) in zip(placed, records, strict=True):
        offsets[index] = offset
    return offsets


class ReusedBuffer:
    """One allocation reused for every tensor, grown to the largest.

    A fresh tensor per read would do the same work, but glibc serves allocations under 32 MiB from its heap
    once a freed block of that size raised its mmap threshold, and the heap fragments: resident memory then
    creeps up to several tensors' worth instead of one.
    """

    def __init__(self) -> None:
        self._storage = torch.empty(0, dtype=torch.uint8)

    def view(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * dtype.itemsize
        if nbytes > self._storage.numel():
            self._storage = torch.empty(0, dtype=torch.uint8)  # free the old one before allocating
            self._storage = torch.empty(nbytes, dtype=torch.uint8)
        return self._storage[:nbytes].view(dtype).view(shape)


def write_at(file: io.BufferedRandom, tensor: torch.Tensor, offset: int) -> None:
    file.seek(offset)
    file.write(tensor.reshape(-1).view(torch.uint8).numpy().data)
