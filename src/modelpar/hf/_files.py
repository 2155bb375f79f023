"""Hugging Face weight folders: which file holds which tensor, and writing safetensors shards tensor by tensor.

A pretrained folder holds ``model.safetensors``, or ``model-00001-of-0000N.safetensors`` files and a
``model.safetensors.index.json`` whose ``weight_map`` says which file holds each tensor.

Writing does not go through ``safetensors.torch.save_file``, which needs every tensor of a file in memory at
once (up to ``max_shard_size``). The format is simple enough to stream: an 8-byte little-endian header length,
a JSON header giving each tensor's dtype, shape and byte range, then the bytes back to back. Shapes and dtypes
are known before any tensor is, so each file's header is written first and each tensor's bytes as it
arrives; memory stays at one tensor.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from safetensors import safe_open

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "Entry",
    "ShardWriter",
    "file_keys",
    "is_pretrained_folder",
    "is_weight_file",
    "parse_size",
    "plan_shards",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# safetensors' names for torch dtypes (the ones its torch backend writes).
_DTYPE_NAMES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


@dataclass(frozen=True)
class Entry:
    """One tensor to write: its name in the file, its full shape and the dtype it is written in."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        numel = 1
        for size in self.shape:
            numel *= size
        return numel * self.dtype.itemsize


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string as Hugging Face writes them (``"5GB"`` is 5e9, ``"5GiB"`` 5 * 2**30)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B)\s*", size, re.IGNORECASE) if isinstance(size, str) else None
    if match is None or float(match[1]) <= 0:
        raise ValueError(
            f"`max_shard_size={size!r}` is not a size. Pass a positive number of bytes or a string such as '5GB'"
            " (units KB, MB, GB, TB in powers of 1000; KiB, MiB, GiB, TiB in powers of 1024)."
        )
    return int(float(match[1]) * _UNITS[match[2].upper()])


def is_pretrained_folder(folder: Path) -> bool:
    """Whether ``folder`` looks like a Hugging Face model folder (``config.json`` and safetensors weights)."""
    has_weights = (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()
    return (folder / "config.json").is_file() and has_weights


def file_keys(folder: str | os.PathLike[str]) -> dict[str, Path]:
    """Every tensor name in the pretrained ``folder``, with the safetensors file holding it."""
    root = Path(folder)
    if not root.is_dir():
        raise FileNotFoundError(
            f"No pretrained model folder at {str(root)!r}. Point to a folder with {SINGLE_FILE!r}, or with"
            f" {INDEX_FILE!r} and the files it lists (what `save_pretrained` writes)."
        )
    index = root / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"The index {str(index)!r} is not valid JSON with a 'weight_map': {err}") from err
        files = {name: root / file for name, file in weight_map.items()}
        absent = sorted({str(f) for f in files.values() if not f.is_file()})
        if absent:
            raise FileNotFoundError(
                f"The index {str(index)!r} lists files that are not in the folder: {absent[:3]}. Download or copy"
                " the complete folder."
            )
        return files
    single = root / SINGLE_FILE
    if single.is_file():
        with safe_open(single, framework="pt") as file:
            return dict.fromkeys(file.keys(), single)
    found = sorted(p.name for p in root.iterdir())
    hint = (
        " It holds PyTorch `.bin` weights: load the model with `from_pretrained` once and `save_pretrained` it"
        " (safetensors is the default), then point here."
        if any(name.endswith(".bin") for name in found)
        else ""
    )
    raise FileNotFoundError(f"No {SINGLE_FILE!r} or {INDEX_FILE!r} in {str(root)!r} (it holds {found[:6]}).{hint}")


def plan_shards(entries: Sequence[Entry], max_bytes: int) -> list[list[Entry]]:
    """Entries in order, split into files of at most ``max_bytes`` (a larger tensor gets a file of its own).

    As Hugging Face splits: a tensor that would overflow the current file starts the next one.
    """
    shards: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.nbytes
    return shards if shards[0] else []


def _header(entries: Sequence[Entry]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for entry in entries:
        if entry.dtype not in _DTYPE_NAMES:
            raise TypeError(f"safetensors cannot store {entry.name!r} of dtype {entry.dtype}.")
        header[entry.name] = {
            "dtype": _DTYPE_NAMES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + entry.nbytes],
        }
        offset += entry.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # as safetensors pads: the data starts 8-byte aligned
    return struct.pack("<Q", len(raw)) + raw


class ShardWriter:
    """Writes ``shards`` (from :func:`plan_shards`) into ``folder``: feed it every entry's tensor, in order.

    One file is open at a time; ``close()`` writes the index when there is more than one file. Nothing is
    synced here: the caller commits the folder (``fsync`` and rename).
    """

    def __init__(self, folder: Path, shards: Sequence[Sequence[Entry]]) -> None:
        self._folder = folder
        self._shards = shards
        self._names = (
            [SINGLE_FILE]
            if len(shards) <= 1
            else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        )
        self._order: Iterator[tuple[int, Entry]] = iter(
            [(i, entry) for i, shard in enumerate(shards) for entry in shard]
        )
        self._file: IO[bytes] | None = None
        self._file_index = -1

    def write(self, tensor: torch.Tensor) -> None:
        """Write the next entry's value (cast to its dtype; the CPU copy is made here if needed)."""
        index, entry = next(self._order)
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{entry.name!r}: expected shape {entry.shape}, got {tuple(tensor.shape)}")
        if index != self._file_index:
            self._close_file()
            self._file = (self._folder / self._names[index]).open("wb")
            self._file.write(_header(self._shards[index]))
            self._file_index = index
        assert self._file is not None
        data = tensor.detach().to("cpu", entry.dtype).contiguous()
        if data.numel():
            self._file.write(data.reshape(-1).view(torch.uint8).numpy().data)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def close(self, total_parameters: int) -> None:
        """Finish the last file and write the index (for more than one file); check every entry was written."""
        if next(self._order, None) is not None:
            raise RuntimeError("ShardWriter closed before every tensor was written")
        if not self._shards:  # a model without tensors: an empty single file, as save_file would write
            (self._folder / SINGLE_FILE).write_bytes(_header([]))
        self._close_file()
        if len(self._shards) > 1:
            index = {
                "metadata": {
                    "total_parameters": total_parameters,
                    "total_size": sum(e.nbytes for shard in self._shards for e in shard),
                },
                "weight_map": {e.name: self._names[i] for i, shard in enumerate(self._shards) for e in shard},
            }
            (self._folder / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def is_weight_file(name: str) -> bool:
    """Whether ``name`` is a weight file this module writes (replaced, never carried over, by a new export)."""
    return name in (SINGLE_FILE, INDEX_FILE) or _SHARD_NAME.fullmatch(name) is not None
