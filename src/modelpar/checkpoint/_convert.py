"""Offline conversion between the two checkpoint formats: one process, no process group, bounded memory.

``convert_to_file`` consolidates a distributed folder into one full file without ever holding the model.
It first lays the file out (``torch.save`` under ``torch.serialization.skip_data`` reserves every tensor's
bytes without writing them), then reads one tensor at a time from the folder with DCP into a buffer and
writes it into its reserved place with plain file writes. Peak memory is about twice the largest tensor
(DCP's read copy and our buffer; a third buffer when casting) on top of the interpreter, whatever the
checkpoint size. (Memory-mapping the output or scratch files instead
keeps *anonymous* memory low, but every page written stays mapped in the process and counts against its
RSS and a container's limit until the whole file is saved.)

``convert_to_distributed`` memory-maps a full file and saves it with DCP, non-tensor entries to ``meta.pt``.

Both write into a staging entry beside the destination and rename it into place only when complete
(:mod:`modelpar.checkpoint._commit`), so an interrupted conversion never leaves a half-written destination.
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from typing_extensions import override

from modelpar._errors import CorruptCheckpointError, WeightsOnlyError
from modelpar.checkpoint._commit import commit, new_token, remove_stale, staging_path
from modelpar.checkpoint._dcp_read import CachedReader, read_local, root_cause, single_process
from modelpar.checkpoint._file_layout import ReusedBuffer, storage_offsets, write_at
from modelpar.checkpoint._format import DCP_METADATA, USER_METADATA, CheckpointFormat
from modelpar.checkpoint._inspect import (
    is_state_entry,
    iter_tensors,
    read_dcp_metadata,
    read_user_metadata,
)
from modelpar.checkpoint._io import detect, read_full_checkpoint
from modelpar.checkpoint._progress import Progress
from modelpar.checkpoint._remote import Location, RemotePath, local_copy, staged_upload, to_location

__all__ = ["convert_to_distributed", "convert_to_file"]

Path_ = tuple[str | int, ...]
Kind = Literal["model", "optimizer", "other"]

# Keyed by the format a direction reads; the message is for a source in the other one.
_WRONG_SOURCE = {
    CheckpointFormat.DISTRIBUTED: (
        "The checkpoint {path!r} is a full checkpoint (one file), but `convert_to_file` converts a distributed"
        " checkpoint folder into a file. To turn this file into a folder, use `convert_to_distributed`"
        " (`modelpar convert SRC DST --to distributed`)."
    ),
    CheckpointFormat.FULL: (
        "The checkpoint {path!r} is a distributed checkpoint (a folder), but `convert_to_distributed` converts a"
        " full checkpoint file into a folder. To consolidate this folder into one file, use `convert_to_file`"
        " (`modelpar convert SRC DST --to file`)."
    ),
}


@dataclass(frozen=True)
class _Item:
    key: str  # DCP's flattened key, e.g. "optimizer.state.norm.weight.exp_avg"
    path: Path_  # where it sits in the nested state, e.g. ("optimizer", "state", "norm.weight", "exp_avg")
    meta: TensorStorageMetadata | BytesStorageMetadata

    @property
    def top(self) -> str:
        return str(self.path[0])


def _check_paths(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], *, want: CheckpointFormat, overwrite: bool
) -> tuple[Location, Location]:
    """Validate before any work: the source exists in the format this direction reads; dst may be written.

    Either may be a URL. The conversions need random access to whole local files, so a URL source is then
    downloaded to a temporary folder and a URL destination written locally and uploaded (:func:`_via_local`).
    """
    src_path, dst_path = to_location(src), to_location(dst)
    if detect(src_path) is not want:  # detect raises FileNotFoundError / ValueError naming the path
        raise ValueError(_WRONG_SOURCE[want].format(path=str(src_path)))
    same = (
        dst_path.resolve() == src_path.resolve()
        if isinstance(src_path, Path) and isinstance(dst_path, Path)
        else str(dst_path) == str(src_path)
    )
    if same:
        raise ValueError(
            f"The destination {str(dst_path)!r} is the source checkpoint itself. Write the conversion to another"
            " path, then replace the source if you want to."
        )
    if dst_path.exists() or dst_path.is_symlink():
        if not overwrite:
            raise FileExistsError(
                f"The destination {str(dst_path)!r} already exists. Pass `overwrite=True` (`--overwrite` on the"
                " command line) to replace it, or choose another path."
            )
        if dst_path.is_dir() and not (dst_path / DCP_METADATA).is_file():
            raise IsADirectoryError(
                f"Refusing to replace {str(dst_path)!r}: it is a folder that is not a checkpoint. Choose a path"
                " inside it, or a new path."
            )
    return src_path, dst_path


@contextmanager
def _via_local(src: Location, dst: Location) -> Iterator[tuple[Path, Path]]:
    """Local stand-ins for a URL source (a download) and a URL destination (uploaded when the body succeeds)."""
    with local_copy(src) as local_src, staged_upload(dst) as local_dst:
        yield local_src, local_dst


@contextmanager
def _staged(dst: Path) -> Iterator[tuple[Path, str]]:
    """A staging path beside ``dst`` that is removed unless the body commits it into place."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dst)
    token = new_token()
    staged = staging_path(dst, token)
    try:
        yield staged, token
    finally:
        if staged.is_dir():
            shutil.rmtree(staged, ignore_errors=True)
        else:
            staged.unlink(missing_ok=True)


def _items(metadata: Metadata) -> list[_Item]:
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    items = []
    for key, meta in metadata.state_dict_metadata.items():
        path = planner_data.get(key)
        items.append(_Item(key, tuple(path) if isinstance(path, (tuple, list)) and path else (key,), meta))
    return items


def _kinds(items: Sequence[_Item]) -> dict[str, Kind]:
    """Per top-level key, from the shape of its nested paths alone.

    A model state dict is flat (``(key, name)``), with tensors; an optimizer's paths run through ``"state"``
    and ``"param_groups"`` (a list, so an index follows); anything else is "other".
    """
    groups: dict[str, list[_Item]] = {}
    for item in items:
        groups.setdefault(item.top, []).append(item)
    kinds: dict[str, Kind] = {}
    for top, group in groups.items():
        seconds = {item.path[1] for item in group if len(item.path) > 1}
        if all(len(i.path) == 2 for i in group) and any(isinstance(i.meta, TensorStorageMetadata) for i in group):
            kinds[top] = "model"
        elif "param_groups" in seconds and seconds <= {"state", "param_groups"}:
            kinds[top] = "optimizer"
        else:
            kinds[top] = "other"
    return kinds


def _put(root: dict[str, Any], path: Path_, value: Any) -> None:
    """Set ``value`` at ``path``, creating dicts for names and lists for indices (DCP flattens lists so)."""
    node: Any = root
    for depth, part in enumerate(path):
        last = depth == len(path) - 1
        fresh = value if last else ([] if isinstance(path[depth + 1], int) else {})
        if isinstance(node, list) and isinstance(part, int):
            node.extend([None] * (part + 1 - len(node)))
            if last or node[part] is None:
                node[part] = fresh
        elif last:
            node[part] = fresh
        else:
            node.setdefault(part, fresh)
        node = node[part]


def _get(root: Any, path: Path_) -> Any:
    for part in path:
        root = root[part]
    return root


def _dcp_load(state: dict[str, Any], reader: CachedReader, src: Path) -> None:
    """Read ``state`` in place (one tensor per call: the reader keeps ``.metadata``, read once)."""
    try:
        read_local(state, reader, partial=True)
    except (Exception, dcp.CheckpointException) as err:  # DCP wraps read errors in a BaseException subclass
        if isinstance(cause := root_cause(err), WeightsOnlyError):  # a refused object, not damage
            raise cause from err
        raise CorruptCheckpointError(
            f"Reading {', '.join(state)[:200]} from the checkpoint {str(src)!r} failed: it is truncated or corrupt"
            f" ({type(err).__name__}: {err})."
        ) from err


def _tensors_in(value: Any, path: Path_) -> Iterator[tuple[Path_, torch.Tensor]]:
    """Tensors reachable through dicts, lists and tuples, with their paths (metadata may hold a few)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, (*path, key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _tensors_in(item, (*path, index))


def _out_dtype(meta: TensorStorageMetadata, kind: Kind, dtype: torch.dtype | None) -> torch.dtype:
    """Only model weights are cast. Optimizer state keeps its dtype: Adam's ``exp_avg_sq`` holds values far below
    float16's smallest (6e-8), which would become 0 and make the first steps after resuming huge; and step
    counters are integers that bfloat16 holds exactly only up to 256. Other tensors are not ours to change.
    """
    saved = meta.properties.dtype
    if dtype is None or kind != "model" or not saved.is_floating_point:
        return saved
    return dtype


def convert_to_file(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    model_only: bool = False,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool | None = None,
) -> None:
    """Consolidate the distributed checkpoint folder ``src`` into the full (single-file) checkpoint ``dst``.

    The file holds ``{"model": full_state_dict, "optimizer": {"state": ..., "param_groups": ...}, ...}`` with
    ``meta.pt``'s entries at the top level, exactly what a full-format save writes. ``model_only`` keeps the
    model state dicts only (no optimizer, no metadata), e.g. for inference. ``dtype`` casts the floating-point
    tensors of the model state dicts; optimizer state (Adam's moments would underflow in float16) and any other
    entry keep their saved dtypes. Memory stays near twice the largest tensor. ``weights_only`` as in
    :func:`~modelpar.checkpoint.load_state`: pass ``False`` only for checkpoints you trust. ``src`` and
    ``dst`` may be URLs (``s3://`` ...): a URL source is downloaded to a temporary folder first.
    """
    src_path, dst_path = _check_paths(src, dst, want=CheckpointFormat.DISTRIBUTED, overwrite=overwrite)
    if isinstance(src_path, RemotePath) or isinstance(dst_path, RemotePath):
        with _via_local(src_path, dst_path) as (local_src, local_dst):
            convert_to_file(
                local_src,
                local_dst,
                model_only=model_only,
                dtype=dtype,
                overwrite=True,  # checked above
                progress=progress,
                weights_only=weights_only,
            )
        return
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"`dtype={dtype!r}` is not a floating-point torch dtype. Pass e.g. `torch.bfloat16`, or `None` to keep"
            " the saved dtypes."
        )
    reader = CachedReader(src_path, read_dcp_metadata(src_path, weights_only=weights_only), weights_only=weights_only)
    items = _items(reader.read_metadata())
    kinds = _kinds(items)
    if model_only:
        items = [item for item in items if kinds[item.top] == "model"]
        if not items:
            found = ", ".join(f"{top!r} ({kind})" for top, kind in kinds.items()) or "nothing"
            raise ValueError(
                f"The checkpoint {str(src_path)!r} holds no model state dict to keep with `model_only=True`; it"
                f" has: {found}. Convert without `model_only`."
            )
    if dtype is not None and "model" not in kinds.values():
        found = ", ".join(f"{top!r} ({kind})" for top, kind in kinds.items()) or "nothing"
        raise ValueError(
            f"The checkpoint {str(src_path)!r} holds no model state dict for `dtype={dtype}` to cast (optimizer state"
            f" and other entries keep their dtypes); it has: {found}. Convert without `dtype`."
        )
    metadata = {} if model_only else read_user_metadata(src_path, weights_only=weights_only)
    if clash := sorted(set(metadata) & {item.top for item in items}):
        raise ValueError(
            f"The checkpoint {str(src_path)!r} has entries {clash} both in its tensor state and in"
            f" {USER_METADATA!r}, so one file cannot hold both. Rename one of them in the source checkpoint."
        )
    tensors = [(item, item.meta) for item in items if isinstance(item.meta, TensorStorageMetadata)]
    non_tensors = {item.key: None for item in items if isinstance(item.meta, BytesStorageMetadata)}
    if non_tensors:
        _dcp_load(non_tensors, reader, src_path)  # small values (param_groups...), all in one read
    out_dtypes = {item.key: _out_dtype(meta, kinds[item.top], dtype) for item, meta in tensors}
    total_bytes = sum(meta.size.numel() * out_dtypes[item.key].itemsize for item, meta in tensors)

    layout: dict[str, Any] = {}
    for item in items:  # in DCP's order, which is the order of the original save
        if isinstance(item.meta, TensorStorageMetadata):
            # A placeholder that is never touched: it costs address space only, not memory.
            _put(layout, item.path, torch.empty(item.meta.size, dtype=out_dtypes[item.key]))
        elif item.key in non_tensors:
            _put(layout, item.path, non_tensors[item.key])
    layout.update(metadata)
    bar = Progress(progress, len(tensors), total_bytes)
    with _staged(dst_path) as (staged, token):
        with torch.serialization.skip_data():
            torch.save(layout, staged)
        del layout
        meta_tensors = list(_tensors_in(metadata, ()))  # e.g. a ModelCheckpoint's best score in meta.pt
        offsets = storage_offsets(staged, [item.path for item, _ in tensors] + [path for path, _ in meta_tensors], _get)
        with staged.open("r+b") as file:
            for (_, value), offset in zip(meta_tensors, offsets[len(tensors) :], strict=True):
                if offset is not None:  # its whole storage: that is what torch.save records
                    raw = torch.empty(0, dtype=torch.uint8).set_(value.untyped_storage())
                    write_at(file, raw, offset)
            read_buffer, cast_buffer = ReusedBuffer(), ReusedBuffer()
            for (item, meta), offset in zip(tensors, offsets[: len(tensors)], strict=True):
                tensor = read_buffer.view(meta.size, meta.properties.dtype)
                _dcp_load({item.key: tensor}, reader, src_path)
                if out_dtypes[item.key] != tensor.dtype:
                    tensor = cast_buffer.view(meta.size, out_dtypes[item.key]).copy_(tensor)
                if offset is not None:
                    write_at(file, tensor, offset)
                bar.advance(tensor.numel() * tensor.element_size())
        commit(dst_path, staged, token)  # fsyncs the file before renaming it into place
    bar.finish(dst_path)


class _CountingSavePlanner(dcp.DefaultSavePlanner):
    """Advances the progress display as DCP's writer asks for each tensor."""

    def __init__(self, bar: Progress) -> None:
        super().__init__()
        self._bar = bar

    @override
    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = super().resolve_data(write_item)
        if write_item.type != WriteItemType.BYTE_IO and isinstance(data, torch.Tensor):
            self._bar.advance(data.numel() * data.element_size())
        return data


def convert_to_distributed(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool | None = None,
) -> None:
    """Shard the full (single-file) checkpoint ``src`` into the distributed checkpoint folder ``dst``.

    Model and optimizer state dicts go to DCP shards, every other top-level entry to ``meta.pt``: the layout
    a distributed save writes, so :func:`modelpar.checkpoint.load_state` restores it on any mesh. The file is
    memory-mapped, not read into memory. ``src`` and ``dst`` may be URLs, as in :func:`convert_to_file`.
    """
    src_path, dst_path = _check_paths(src, dst, want=CheckpointFormat.FULL, overwrite=overwrite)
    if isinstance(src_path, RemotePath) or isinstance(dst_path, RemotePath):
        with _via_local(src_path, dst_path) as (local_src, local_dst):
            convert_to_distributed(local_src, local_dst, overwrite=True, progress=progress, weights_only=weights_only)
        return
    checkpoint = read_full_checkpoint(src_path, weights_only)
    state = {key: value for key, value in checkpoint.items() if is_state_entry(value)}
    if not state:
        raise ValueError(
            f"The checkpoint file {str(src_path)!r} holds no model or optimizer state dict (its top-level entries:"
            f" {', '.join(map(repr, checkpoint)) or 'none'}), so there is nothing to shard. Point to a file saved"
            " with a model in its state."
        )
    metadata = {key: value for key, value in checkpoint.items() if key not in state}
    tensors = [tensor for _, tensor in iter_tensors(state, "")]
    bar = Progress(progress, len(tensors), sum(t.numel() * t.element_size() for t in tensors))
    with _staged(dst_path) as (staged, token):
        staged.mkdir()
        with single_process():
            dcp.save(
                state, storage_writer=dcp.FileSystemWriter(staged), planner=_CountingSavePlanner(bar), no_dist=True
            )
        torch.save(metadata, staged / USER_METADATA)
        commit(dst_path, staged, token)
    bar.finish(dst_path)
