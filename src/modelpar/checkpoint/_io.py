"""Saving and loading the two checkpoint formats with torch.distributed.checkpoint (DCP).

* distributed: a folder of DCP shards plus ``meta.pt`` with the non-tensor state (rank 0). Every rank
  writes only what it owns, and DCP reshards on load, so the folder loads on any mesh layout.
* full: one ``torch.save`` file written by rank 0 with full (unsharded) state dicts, optimizer state keyed
  by parameter name, and the metadata at the top level.

Every function here is collective: all ranks call it with the same arguments.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from modelpar.checkpoint._format import USER_METADATA, CheckpointFormat, detect_format
from modelpar.checkpoint._state import FilterFns, SplitState, apply_filter, metadata_of, restore_metadata

__all__ = ["load", "load_module_full_state", "save"]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _clear_conflicting(path: Path, want_dir: bool) -> None:
    """Replace a file by a folder (or back) once, on rank 0, then let everyone through.

    Lightning 2.6.6 removes the old entry on every rank at once, which races and can fail.
    """
    if _rank() == 0:
        if want_dir and path.is_file():
            path.unlink()
        elif not want_dir and path.is_dir():
            shutil.rmtree(path)
    _barrier()


def save(path: Path, split: SplitState, *, full: bool, filters: FilterFns | None = None) -> None:
    """Write ``split`` to ``path`` in the distributed (folder) or full (single file) format."""
    if not split.modules and not split.optimizers:
        raise ValueError(
            "The checkpoint state contains no model and no optimizer. Pass them in like"
            " `save(path, {'model': model, 'optimizer': optimizer, ...})`, set up through the strategy first."
        )
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    tensors: dict[str, Any] = {}
    for key, module in split.modules.items():
        tensors[key] = apply_filter(key, filters, get_model_state_dict(module, options=options))
    for key, (optimizer, owner) in split.optimizers.items():
        tensors[key] = apply_filter(key, filters, get_optimizer_state_dict(owner, optimizer, options=options))
    metadata = {k: apply_filter(k, filters, v) for k, v in metadata_of(split.other).items()}
    _clear_conflicting(path, want_dir=not full)
    if full:
        if _rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save({**tensors, **metadata}, path)
    else:
        dcp.save(tensors, checkpoint_id=path)
        if _rank() == 0:
            torch.save(metadata, path / USER_METADATA)
    _barrier()


def load(
    path: Path, split: SplitState, state: dict[str, Any], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Restore models, optimizers and metadata from ``path`` (format detected); return the unrequested rest."""
    fmt = detect_format(path)
    if fmt is CheckpointFormat.DISTRIBUTED:
        return _load_distributed(path, split, state, strict=strict, weights_only=weights_only)
    return _load_full(path, split, state, strict=strict, weights_only=weights_only)


def _saved_keys(path: Path) -> set[str]:
    return set(dcp.FileSystemReader(path).read_metadata().state_dict_metadata)


def _load_distributed(
    path: Path, split: SplitState, state: dict[str, Any], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    saved = _saved_keys(path)
    planner = dcp.DefaultLoadPlanner(allow_partial_load=not strict)
    for key, module in split.modules.items():
        module_state = get_model_state_dict(module)
        missing = [name for name in module_state if f"{key}.{name}" not in saved]
        if strict and missing:
            raise KeyError(
                f"The checkpoint {str(path)!r} has no entry for {key!r} parameter {missing[0]!r}"
                f" ({len(missing)} missing in all). Pass `strict=False` to load the rest."
            )
        module_state = {k: v for k, v in module_state.items() if k not in missing}
        dcp.load({key: module_state}, checkpoint_id=path, planner=planner)
        set_model_state_dict(module, module_state, options=StateDictOptions(strict=False))
    for key, (optimizer, owner) in split.optimizers.items():
        if not any(k.startswith(f"{key}.") for k in saved):
            if strict:
                raise KeyError(f"The checkpoint {str(path)!r} has no optimizer state under {key!r}.")
            continue
        optim_state = get_optimizer_state_dict(owner, optimizer)
        dcp.load({key: optim_state}, checkpoint_id=path, planner=planner)
        set_optimizer_state_dict(owner, optimizer, optim_state)
    meta_path = path / USER_METADATA
    saved_meta: dict[str, Any] = torch.load(meta_path, weights_only=weights_only) if meta_path.is_file() else {}
    return restore_metadata(split.other, state, saved_meta, strict, str(path))


def _load_full(
    path: Path, split: SplitState, state: dict[str, Any], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    # mmap: every rank maps the file instead of reading a private copy of the whole model into memory.
    checkpoint: dict[str, Any] = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    for key, module in split.modules.items():
        if key not in checkpoint:
            if strict:
                raise KeyError(f"The checkpoint {str(path)!r} has no model state under {key!r}.")
            continue
        load_module_full_state(module, checkpoint.pop(key), strict=strict)
    for key, (optimizer, owner) in split.optimizers.items():
        if key not in checkpoint:
            if strict:
                raise KeyError(f"The checkpoint {str(path)!r} has no optimizer state under {key!r}.")
            continue
        options = StateDictOptions(full_state_dict=True, strict=strict)
        set_optimizer_state_dict(owner, optimizer, checkpoint.pop(key), options=options)
    return restore_metadata(split.other, state, checkpoint, strict, str(path))


def load_module_full_state(module: nn.Module, full_state: Mapping[str, Any], *, strict: bool) -> None:
    """Load a full (unsharded) state dict into a sharded or plain module, one tensor at a time.

    One tensor at a time keeps the extra memory near the largest tensor when ``full_state`` is memory-mapped.
    """
    if not any(isinstance(p, DTensor) for p in module.parameters()):
        module.load_state_dict(full_state, strict=strict)
        return
    expected = get_model_state_dict(module)
    missing = [k for k in expected if k not in full_state]
    unexpected = [k for k in full_state if k not in expected]
    if strict and (missing or unexpected):
        raise KeyError(
            f"The full state does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}."
            " Pass `strict=False` to load the matching entries only."
        )
    options = StateDictOptions(full_state_dict=True, strict=False)
    for name in expected:
        if name in full_state:
            set_model_state_dict(module, {name: full_state[name]}, options=options)
