"""Reading and writing the two checkpoint formats with torch.distributed.checkpoint (DCP).

* distributed: a folder of DCP shards plus ``meta.pt`` with the non-tensor state (rank 0). Every rank
  writes only what it owns, and DCP reshards on load, so the folder loads on any mesh layout.
* full: one ``torch.save`` file written by rank 0 with full (unsharded) state dicts, optimizer state keyed
  by parameter name, and the metadata at the top level.

Where a checkpoint comes from and when it becomes visible is :mod:`modelpar.checkpoint._checkpointer`'s
business; this module only turns states into bytes and back. Every function is collective unless noted.
"""

from __future__ import annotations

import pickle
import re
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from modelpar._errors import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    WeightsOnlyError,
)
from modelpar.checkpoint._agree import gather, not_shared_error
from modelpar.checkpoint._commit import describe_leftovers
from modelpar.checkpoint._dcp_read import CachedReader, read_local, root_cause
from modelpar.checkpoint._format import COMMIT_MARKER, DCP_METADATA, USER_METADATA, WRITING_MARKER, CheckpointFormat
from modelpar.checkpoint._pipeline import full_pipelined_model_state, full_pipelined_optimizer_state, is_pipelined
from modelpar.checkpoint._remote import Location, RemotePath, prefix_state, to_location, torch_load_remote
from modelpar.checkpoint._state import (
    FilterFns,
    SplitState,
    apply_filter,
    metadata_of,
    restore_metadata,
    state_dict_options,
)
from modelpar.checkpoint._stream import check_shapes, load_full_model_state, load_full_optimizer_state

__all__ = ["detect", "gather_state", "load", "load_raw_module", "load_trainer_layout", "read_full_checkpoint"]


def detect(path: Location | str) -> CheckpointFormat:
    """The format at ``path``; errors name the path, interrupted saves beside it, and what was expected."""
    path = to_location(path)
    if isinstance(path, RemotePath):
        return _detect_remote(path)
    if path.is_file():
        return CheckpointFormat.FULL
    if path.is_dir():
        if (path / DCP_METADATA).is_file():
            return CheckpointFormat.DISTRIBUTED
        if any(path.glob("*.distcp")):
            raise ValueError(
                f"The checkpoint {str(path)!r} is incomplete: it has shard files but no {DCP_METADATA!r}, so the"
                " save that wrote it did not finish. Load an earlier checkpoint."
            )
        raise ValueError(
            f"The folder {str(path)!r} does not point to a valid checkpoint: it has no {DCP_METADATA!r} file. Point to"
            " a folder written by `save_checkpoint` (or torch.distributed.checkpoint), or to a single-file"
            f" checkpoint.{describe_leftovers(path)}"
        )
    raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}: the path does not exist.{describe_leftovers(path)}")


def _detect_remote(path: RemotePath) -> CheckpointFormat:
    """:func:`detect` at a URL, where an incomplete save is told by its markers (see ``_remote``)."""
    if path.is_file():
        return CheckpointFormat.FULL
    if path.is_dir():
        state = prefix_state(path)
        if state == "partial":
            raise CheckpointNotFoundError(
                f"No complete checkpoint at {str(path)!r}: a save to it is under way or was interrupted (it has"
                f" {WRITING_MARKER!r} but no {COMMIT_MARKER!r}), so it is treated as absent. Load an earlier"
                " checkpoint; the next save to this URL replaces it."
            )
        if state in ("complete", "foreign"):
            return CheckpointFormat.DISTRIBUTED
        raise ValueError(
            f"{str(path)!r} does not point to a valid checkpoint: it has no {DCP_METADATA!r} object. Point to a"
            " checkpoint written by `save_checkpoint` (or torch.distributed.checkpoint), or to a single-file one."
        )
    raise CheckpointNotFoundError(f"No checkpoint at {str(path)!r}: nothing exists at that URL.")


def detect_shared(path: Location) -> CheckpointFormat:
    """:func:`detect` on every rank, agreed (a collective): the same format, or the same error, everywhere.

    Ranks that see different things at ``path`` (node-local disks, a file system slow to show a rename) all
    raise one error saying the path is not shared, instead of some entering the load while others raise.
    """
    for attempt in range(2):  # once more after a moment: a file system may show a fresh rename late
        error: Exception | None = None
        try:
            view = detect(path).value
        except Exception as err:  # not only OSError: an object store's client raises its own errors
            error, view = err, type(err).__name__
        views = gather(view)
        if len({view for view, _ in views}) == 1:
            break
        if attempt == 0:
            time.sleep(1.0)
    else:
        raise not_shared_error(path, [(_seen(view), host) for view, host in views], "load")
    if error is not None:
        raise error
    return CheckpointFormat(view)


def _seen(view: str) -> str:
    formats = {f.value: f"a {f.value} checkpoint" for f in CheckpointFormat}
    return formats.get(view, "no checkpoint" if "NotFound" in view else f"no loadable checkpoint ({view})")


def gather_state(split: SplitState, *, full: bool, filters: FilterFns | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensor state, metadata): sharded state dicts, or full ones gathered to CPU for the single-file format."""
    options = state_dict_options(full=full)
    tensors: dict[str, Any] = {}
    for key, module in split.modules.items():
        if full and is_pipelined(module):  # rank 0 holds only its stages: gather every stage's (``_pipeline``)
            tensors[key] = apply_filter(key, filters, full_pipelined_model_state(module))
            continue
        tensors[key] = apply_filter(key, filters, get_model_state_dict(module, options=options))
    for key, (optimizer, owner) in split.optimizers.items():
        if full and is_pipelined(owner):
            tensors[key] = apply_filter(key, filters, full_pipelined_optimizer_state(owner, optimizer))
            continue
        tensors[key] = apply_filter(key, filters, get_optimizer_state_dict(owner, optimizer, options=options))
    metadata = {k: apply_filter(k, filters, v) for k, v in metadata_of(split.other).items()}
    return tensors, metadata


def load(
    path: Location, split: SplitState, state: dict[str, Any], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Restore models, optimizers and metadata from ``path`` (format detected); return the unrequested rest."""
    if detect_shared(path) is CheckpointFormat.DISTRIBUTED:
        return _load_distributed(path, split, state, strict=strict, weights_only=weights_only)
    checkpoint = read_full_checkpoint(path, weights_only)
    for key, module in split.modules.items():
        if key not in checkpoint:
            _missing(path, key, strict, list(checkpoint))
            continue
        load_full_model_state(module, checkpoint.pop(key), strict=strict, where=f"{str(path)!r} [{key!r}]")
    for key, (optimizer, owner) in split.optimizers.items():
        if key not in checkpoint:
            _missing(path, key, strict, list(checkpoint))
            continue
        where = f"{str(path)!r} [{key!r}]"
        load_full_optimizer_state(owner, optimizer, checkpoint.pop(key), strict=strict, where=where)
    return restore_metadata(split.other, state, checkpoint, strict, str(path))


def _missing(path: Location, key: str, strict: bool, present: list[str]) -> None:
    if strict:
        raise CheckpointKeyError(
            f"The requested state contains a key {key!r} that does not exist in the checkpoint {str(path)!r} (it has:"
            f" {', '.join(map(repr, present)) or 'nothing'}). Pass `strict=False` to skip it."
        )


def read_full_checkpoint(path: Location, weights_only: bool | None = True) -> dict[str, Any]:
    """The memory-mapped contents of a full file; errors say why a file is not a readable checkpoint.

    mmap: every rank maps the file instead of reading a private copy of the whole model into memory. At a
    URL there is nothing to map: each process reads the object into memory.
    """
    try:
        if isinstance(path, RemotePath):
            loaded = torch_load_remote(path, weights_only)
        else:
            loaded = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
        what = f"`{refused.group(1)}`" if refused else "a custom object"
        raise WeightsOnlyError(
            f"The checkpoint file {str(path)!r} holds {what}, which loading with `weights_only=True` (torch's"
            " default) refuses to unpickle. Pass `weights_only=False` if you trust the file, or allow the class"
            " with `torch.serialization.add_safe_globals([...])`."
        ) from err
    except Exception as err:  # torch raises RuntimeError, EOFError ... for damaged files
        raise CorruptCheckpointError(
            f"The checkpoint file {str(path)!r} cannot be read: it is truncated, corrupt, or not a checkpoint"
            f" ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})."
        ) from err
    if not isinstance(loaded, dict):
        raise ValueError(f"The checkpoint file {str(path)!r} holds a {type(loaded).__name__}, not a dict of state.")
    return loaded


def _open(path: Location, weights_only: bool | None) -> CachedReader:
    """A reader of the folder ``path`` with its ``.metadata`` read, once for the checks and the reading alike.

    ``weights_only`` (true or ``None``): ``.metadata`` and the non-tensor entries are unpickled safely.
    """
    reader = CachedReader(path, weights_only=weights_only)
    try:
        reader.read_metadata()
    except WeightsOnlyError:
        raise
    except Exception as err:
        raise CorruptCheckpointError(
            f"The checkpoint {str(path)!r} has an unreadable {DCP_METADATA!r} file: {err}"
        ) from err
    return reader


def _dcp_load(state: dict[str, Any], reader: CachedReader, path: Location, strict: bool) -> None:
    """Fill ``state`` in place, each rank reading on its own; a failure on any rank raises on every rank.

    One small all-gather of the outcome replaces the three collectives of each ``dcp.load`` call.
    """
    error: BaseException | None = None
    what: tuple[str, bool] | None = None  # (what went wrong, whether weights_only refused an object)
    try:
        read_local(state, reader, partial=not strict)
    except BaseException as err:  # DCP wraps what goes wrong in a CheckpointException (a BaseException)
        cause = root_cause(err)
        if not isinstance(cause, Exception):  # KeyboardInterrupt and the like: not about the checkpoint
            raise
        detail = str(cause).splitlines()[0] if str(cause) else ""
        if isinstance(cause, WeightsOnlyError):  # not damage: its message names the object and the fix
            what = (str(cause), True)
        else:
            what = (f"{type(cause).__name__}: {detail}" if detail else type(cause).__name__, False)
        error = err
    outcomes = [outcome for outcome, _host in gather(what)]  # one all-gather, as for every shared outcome
    failed = [(rank, w) for rank, w in enumerate(outcomes) if w is not None]
    if failed:
        rank, (text, refused) = failed[0]
        where = ""
        if dist.is_initialized():
            where = f" on rank {rank}" + (f" (and {len(failed) - 1} more)" if len(failed) > 1 else "")
        if refused:
            raise WeightsOnlyError(f"{text} (Raised{where}.)" if where else text) from error
        raise CorruptCheckpointError(
            f"Reading the checkpoint {str(path)!r} failed{where}: it is truncated or corrupt ({text})."
        ) from error


def _load_distributed(
    path: Location,
    split: SplitState,
    state: dict[str, Any],
    *,
    strict: bool,
    weights_only: bool | None,
    reader: CachedReader | None = None,
    module_states: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Restore ``split`` from the folder ``path`` with one rank-local DCP read for all models and optimizers.

    Model keys and shapes are checked and ``meta.pt`` is read before any tensor, identically on every rank,
    so these errors raise everywhere before a model or optimizer changes. ``reader`` and ``module_states``
    (by key, from ``get_model_state_dict``) may come from the caller, which looked at them already.
    """
    reader = reader or _open(path, weights_only)
    saved = reader.read_metadata().state_dict_metadata
    to_read: dict[str, Any] = {}
    for key, module in split.modules.items():
        module_state = (module_states or {}).get(key)
        if module_state is None:
            module_state = get_model_state_dict(module)
        shapes = {
            k[len(key) + 1 :]: m.size
            for k, m in saved.items()
            if k.startswith(f"{key}.") and isinstance(m, TensorStorageMetadata)
        }
        check_shapes(module_state, shapes, f"{str(path)!r} [{key!r}]")
        missing = [name for name in module_state if f"{key}.{name}" not in saved]
        if strict and missing:
            raise CheckpointKeyError(
                f"The model {key!r} contains a key {missing[0]!r} that does not exist in the checkpoint"
                f" {str(path)!r} ({len(missing)} missing in all). Pass `strict=False` to load the rest."
            )
        to_read[key] = {k: v for k, v in module_state.items() if k not in missing}
    optimizers = {}
    for key, (optimizer, owner) in split.optimizers.items():
        if not any(k.startswith(f"{key}.") for k in saved):
            _missing(path, key, strict, sorted({k.split(".")[0] for k in saved}))
            continue
        to_read[key] = get_optimizer_state_dict(owner, optimizer)
        optimizers[key] = (optimizer, owner)
    meta_path = path / USER_METADATA
    saved_meta: dict[str, Any] = read_full_checkpoint(meta_path, weights_only) if meta_path.is_file() else {}
    if to_read:
        _dcp_load(to_read, reader, path, strict)
    for key, module in split.modules.items():
        set_model_state_dict(module, to_read[key], options=StateDictOptions(strict=False))
    for key, (optimizer, owner) in optimizers.items():
        set_optimizer_state_dict(owner, optimizer, to_read[key])
    return restore_metadata(split.other, state, saved_meta, strict, str(path))


def load_raw_module(path: Location, module: nn.Module, *, strict: bool, weights_only: bool | None) -> None:
    """Load weights only into ``module`` (sharded or plain): a raw state-dict file, or a model in a folder."""
    if detect_shared(path) is CheckpointFormat.FULL:
        load_full_model_state(module, read_full_checkpoint(path, weights_only), strict=strict, where=repr(str(path)))
        return
    reader = _open(path, weights_only)
    saved = reader.read_metadata().state_dict_metadata
    module_state = get_model_state_dict(module)
    names = list(module_state)
    prefixes = sorted({k.split(".")[0] for k in saved if names and k.endswith("." + names[0])})
    if len(prefixes) != 1:
        raise ValueError(
            f"Cannot tell which model in the distributed checkpoint {str(path)!r} to load: entries matching the"
            f" module's parameters sit under {prefixes or 'no key'}. Load with `state={{'<key>': model}}` instead."
        )
    key = prefixes[0]
    split = SplitState(modules={key: module})
    _load_distributed(
        path, split, {}, strict=strict, weights_only=weights_only, reader=reader, module_states={key: module_state}
    )


def load_trainer_layout(
    path: Location, module: nn.Module, optimizers: list[Optimizer], *, strict: bool, weights_only: bool | None
) -> dict[str, Any]:
    """Restore the model and the optimizers of a Lightning Trainer checkpoint; return the rest of it.

    Distributed folders hold the model under ``"state_dict"`` (Lightning's ``ModelParallelStrategy``, ours) or
    ``"model"`` (Lightning's FSDP1 ``FSDPStrategy``), and the optimizers as ``"optimizer_<i>"``.
    """
    if detect_shared(path) is CheckpointFormat.DISTRIBUTED:
        # Lightning's ModelParallelStrategy keys the model "state_dict"; its FSDP (FSDP1) strategy keys it "model".
        reader = _open(path, weights_only)
        keys = list(reader.read_metadata().state_dict_metadata)
        has_state_dict = any(k.startswith("state_dict.") for k in keys)
        model_key = "model" if not has_state_dict and any(k.startswith("model.") for k in keys) else "state_dict"
        split = SplitState(
            modules={model_key: module},
            optimizers={f"optimizer_{i}": (opt, module) for i, opt in enumerate(optimizers)},
        )
        return _load_distributed(path, split, {}, strict=strict, weights_only=weights_only, reader=reader)
    checkpoint = read_full_checkpoint(path, weights_only)
    model_key = "state_dict" if "state_dict" in checkpoint else "model"  # "model": a converted FSDP1 folder
    if model_key not in checkpoint:
        raise CheckpointKeyError(
            f"The checkpoint file {str(path)!r} has no 'state_dict' entry, so it was not written by a Lightning"
            f" Trainer (it has: {', '.join(map(repr, list(checkpoint)[:8]))}). Load it with `fabric.load` instead."
        )
    load_full_model_state(module, checkpoint.pop(model_key), strict=strict, where=f"{str(path)!r} [{model_key!r}]")
    saved = checkpoint.pop("optimizer_states", None)
    if saved is None:  # a converted folder keeps the folder's "optimizer_<i>" entries
        numbered = sorted((k for k in checkpoint if re.fullmatch(r"optimizer_\d+", k)), key=lambda k: int(k[10:]))
        saved = [checkpoint.pop(k) for k in numbered]
    if optimizers and len(saved) != len(optimizers):
        hint = (
            " It holds only the model (saved with `save_weights_only=True`?): load it with `ckpt_path` in"
            " validate/test/predict, or into the model directly."
            if not saved
            else " Restore with the same `configure_optimizers`."
        )
        raise CheckpointKeyError(
            f"The checkpoint {str(path)!r} holds {len(saved)} optimizer state(s) but the LightningModule"
            f" configures {len(optimizers)} optimizer(s).{hint}"
        )
    for i, (opt, opt_state) in enumerate(zip(optimizers, saved, strict=False)):
        where = f"{str(path)!r} ['optimizer_states'][{i}]"
        load_full_optimizer_state(module, opt, opt_state, strict=strict, where=where)
    return checkpoint
