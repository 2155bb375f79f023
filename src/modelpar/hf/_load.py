"""Pretrained Hugging Face weights into a (sharded) model: each rank reads only its own block of each tensor.

The safetensors files are memory-mapped (``safe_open``) on every rank. For each tensor the rank works out
from its parameter's placements which block of the full tensor it holds (the logic of
:mod:`modelpar.checkpoint._stream`, FSDP2's ``_StridedShard`` included), reads just that block
(``get_slice(name)[...]``) and copies it into its local shard, cast to the model's dtype. No communication,
no rank ever holds the whole model, and the extra memory stays near the largest tensor's shard.

Mixture-of-experts models hold each layer's experts fused (``experts.gate_up_proj`` ``[E, 2*I, H]``), folders
often one tensor per expert (:mod:`modelpar.hf._experts`): such a tensor's block is filled from the experts
(and gate/up rows) it covers, each read as a slice of its own file tensor.

Names, shapes and tied weights are checked first, identically on every rank, so a mismatch raises on every
rank before anything is modified. Buffers that are not in the files (rotary ``inv_freq``, which Hugging Face
never saves) keep the values the model computed.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor, distribute_tensor

from modelpar._errors import CheckpointKeyError
from modelpar.checkpoint._pipeline import expected_elsewhere
from modelpar.checkpoint._stream import check_shapes, shard_block
from modelpar.hf._experts import Stacked, group_experts, stacked_shape
from modelpar.hf._files import file_keys
from modelpar.hf._keys import ignored_unexpected, map_file_keys, model_tensors, unwrap

__all__ = ["Handles", "fill_block", "load_pretrained"]


def load_pretrained(
    model: Any, path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, strict: bool = True
) -> None:
    """Load the pretrained weights in the folder ``path`` into ``model``, in place, on every rank.

    ``model`` is a Hugging Face ``PreTrainedModel`` (or any module whose state-dict names are the files'),
    sharded by the strategy (FSDP2 and/or tensor-parallel DTensors, e.g. built on the meta device and set up
    with ``fabric.setup_module``), or plain on one process. ``path`` holds ``model.safetensors``, or sharded
    ``model-0000x-of-0000y.safetensors`` files with ``model.safetensors.index.json``. Each rank reads only the
    blocks it holds, from memory-mapped files: the extra memory per rank is about the largest tensor's shard.
    Tied weights (``lm_head.weight`` with ``tie_word_embeddings``) may be absent from the files and stay tied.
    Mixture-of-experts folders may hold the experts fused, as the model does, or one tensor per expert
    (Qwen3-MoE's ``experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight`` ...).

    Each tensor is cast to the dtype of the model's tensor it goes into (a bfloat16 file into a float32 model
    gives float32 weights holding the bfloat16 values). ``dtype``, if given, is the floating-point dtype you
    expect the model's weights to have: checked before anything is read, since a set-up model's dtype is fixed
    (build it in that dtype, e.g. with Fabric's ``precision="bf16-true"``).

    ``strict``: every tensor of the model must be in the files and every tensor of the files in the model
    (:class:`~modelpar.CheckpointKeyError` otherwise); ``False`` loads the matching ones. Shapes must match
    (:class:`~modelpar.CheckpointShapeError`). Both are checked on every rank before anything is modified.
    Not collective: ranks never communicate, but every rank of a sharded model must call it.
    """
    module = unwrap(model)
    where = f"the pretrained folder {str(Path(path))!r}"
    located = file_keys(path)
    ours = model_tensors(module)
    if dtype is not None:
        _check_dtype(ours.tensors, dtype)
    ignored = ignored_unexpected(module)
    to_model = map_file_keys(located, ours.tensors, getattr(module, "base_model_prefix", "") or "")
    direct, stacked = group_experts(to_model, ours.tensors, strict=strict)
    from_file: dict[str, str | Stacked] = {model_name: file_name for file_name, model_name in direct.items()}
    from_file.update(stacked)
    # A pipeline stage holds its own tensors; the other stages' are expected in the files too, and every stage
    # checks the whole model's names, so all ranks reach the same verdict.
    elsewhere = expected_elsewhere(module)
    unexpected = [
        k
        for k, name in direct.items()
        if name not in ours.tensors and name not in elsewhere and not any(p.search(k) for p in ignored)
    ]
    # A tied tensor needs one of its names in the files; which one it is found under does not matter.
    sources = {first: next((n for n in names if n in from_file), None) for first, names in ours.aliases.items()}
    missing = [first for first, source in sources.items() if source is None]
    missing += sorted(n for n in elsewhere if n not in ours.tensors and n not in from_file)
    if strict and (missing or unexpected):
        raise CheckpointKeyError(
            f"The weights in {where} do not match the model ({type(module).__name__}): {len(missing)} missing"
            f" (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}). Build the model from"
            " the folder's own config (`AutoConfig.from_pretrained(path)`), or pass `strict=False` to load the"
            " matching tensors only."
        )
    # Separate tensors in the files for names the model ties (an untied model's folder into a tied model):
    # one would be dropped. (Checkpoints that store a tied tensor twice load with `strict=False`.)
    doubled = [names for names in ours.aliases.values() if sum(n in from_file for n in names) > 1]
    if strict and doubled:
        raise CheckpointKeyError(
            f"The weights in {where} hold separate tensors for {doubled[0]}, which the model ties (one tensor), so"
            " one of them would be dropped. Build the model from the folder's own config (for Llama-style models,"
            " `tie_word_embeddings=False`), or pass `strict=False` to load the first of them into the tied tensor."
        )
    picked = {first: from_file[source] for first, source in sources.items() if source is not None}
    shapes = _file_shapes(located, picked, where)
    check_shapes({first: ours.tensors[first] for first in shapes}, shapes, where)

    by_file: dict[Path, list[tuple[str, str]]] = {}
    for first, file_name in picked.items():
        if isinstance(file_name, str):
            by_file.setdefault(located[file_name], []).append((file_name, first))
    with torch.no_grad():
        for file, pairs in by_file.items():
            with safe_open(file, framework="pt") as handle:
                for file_name, first in pairs:
                    _load_one(handle, file_name, ours.tensors[first])
        with Handles(located) as handles:
            for first, parts in picked.items():
                if isinstance(parts, Stacked):
                    _load_stacked(handles, parts, ours.tensors[first])


def _check_dtype(tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"`dtype={dtype!r}` is not a floating-point torch dtype. Pass e.g. `torch.bfloat16`, or None.")
    other = {name: t.dtype for name, t in tensors.items() if t.is_floating_point() and t.dtype != dtype}
    if other:
        example = next(iter(other.items()))
        raise TypeError(
            f"`dtype={dtype}` was given, but the model holds {len(other)} floating-point tensor(s) in other dtypes"
            f" (e.g. {example[0]!r} in {example[1]}). `load_pretrained` fills the model's own tensors and cannot"
            ' change their dtype: build the model in that dtype (Fabric\'s `precision="bf16-true"` for bfloat16),'
            " or leave `dtype` out to cast the weights to the model's dtypes."
        )


def _file_shapes(located: dict[str, Path], wanted: dict[str, str | Stacked], where: str) -> dict[str, tuple[int, ...]]:
    """The saved shape of each wanted tensor (model name -> its file tensor(s)), from the files' headers only."""
    file_names = [n for source in wanted.values() for n in ([source] if isinstance(source, str) else source.names)]
    by_file: dict[Path, list[str]] = {}
    for file_name in file_names:
        by_file.setdefault(located[file_name], []).append(file_name)
    saved: dict[str, tuple[int, ...]] = {}
    for file, names in by_file.items():
        with safe_open(file, framework="pt") as handle:
            for file_name in names:
                saved[file_name] = tuple(handle.get_slice(file_name).get_shape())
    return {
        model_name: saved[source] if isinstance(source, str) else stacked_shape(model_name, source, saved, where)
        for model_name, source in wanted.items()
    }


def _load_one(handle: Any, name: str, target: torch.Tensor) -> None:
    """Read this rank's block of ``name`` and copy it into ``target``'s local shard (cast to its dtype)."""
    local = target.to_local() if isinstance(target, DTensor) else target
    if local.numel() == 0:
        return
    block = shard_block(target)
    if block is None:  # placements our cut does not cover: DTensor slices the full tensor itself
        assert isinstance(target, DTensor)
        full = handle.get_tensor(name)
        value = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
    elif not block:  # a 0-dim tensor
        value = handle.get_tensor(name)
    else:
        value = handle.get_slice(name)[tuple(slice(start, start + length) for start, length in block)]
    if value.shape != local.shape:  # copy_ would broadcast a wrong block silently; never expected to happen
        raise NotImplementedError(
            f"Cannot cut the shard of {name!r} with placements {getattr(target, 'placements', None)} and local"
            f" shape {tuple(local.shape)} out of the file: the cut gives {tuple(value.shape)}. Please report the"
            " layout to modelpar."
        )
    local.copy_(value)


class Handles(contextlib.ExitStack):
    """The folder's safetensors files, each memory-mapped once when first needed (per-expert tensors of one
    fused tensor may lie in several files)."""

    def __init__(self, located: dict[str, Path]) -> None:
        super().__init__()
        self._located = located
        self._open: dict[Path, Any] = {}

    def slice(self, name: str) -> Any:
        file = self._located[name]
        if file not in self._open:
            self._open[file] = self.enter_context(safe_open(file, framework="pt"))
        return self._open[file].get_slice(name)


def _load_stacked(handles: Handles, stacked: Stacked, target: torch.Tensor) -> None:
    """Fill ``target``'s local shard of a fused expert tensor from the per-expert file tensors: for this rank's
    block (experts x rows x columns), only the experts it holds and, of each, only the rows and columns it holds."""
    local = target.to_local() if isinstance(target, DTensor) else target
    if local.numel() == 0:
        return
    block = shard_block(target)
    if block is None:  # placements our cut does not cover: stack the full tensor, DTensor cuts it
        assert isinstance(target, DTensor)
        full = torch.stack([torch.cat([handles.slice(n)[:] for n in expert]) for expert in stacked.parts])
        local.copy_(distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local())
        return
    if tuple(local.shape) != tuple(length for _, length in block):  # never expected: copy_ would broadcast
        raise NotImplementedError(
            f"Cannot cut the shard of placements {getattr(target, 'placements', None)} and local shape"
            f" {tuple(local.shape)} out of per-expert tensors (block {block}). Please report the layout to modelpar."
        )
    fill_block(handles, stacked, local, block)


def fill_block(handles: Handles, stacked: Stacked, local: torch.Tensor, block: list[tuple[int, int]]) -> None:
    """Copy the ``block`` ((start, length) of experts, rows, columns) of the fused tensor into ``local``."""
    (e0, experts), (r0, rows), (c0, cols) = block
    for i, expert in enumerate(stacked.parts[e0 : e0 + experts]):
        offset = 0
        for name in expert:
            part = handles.slice(name)
            length = part.get_shape()[0]
            lo, hi = max(r0, offset), min(r0 + rows, offset + length)
            if lo < hi:
                local[i, lo - r0 : hi - r0].copy_(part[lo - offset : hi - offset, c0 : c0 + cols])
            offset += length
