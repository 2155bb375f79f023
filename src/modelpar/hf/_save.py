"""A running (sharded) model saved as a Hugging Face pretrained folder, gathering one tensor at a time.

Collective: every rank walks the model's tensors in the same order and gathers each in turn
(``DTensor.full_tensor()``); rank 0 writes it into its safetensors file and drops it before the next. So no
rank ever holds more than one full tensor beyond its shards. A CPU-offloaded shard is copied to its mesh's
device for its gather (NCCL cannot communicate CPU tensors), also one at a time. Rank 0 writes into a staging
folder and renames it into place at the end; a failure on rank 0 (a full disk) does not stop the others
mid-way: they finish the gathers, and all ranks then raise it together.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from modelpar._mesh.collective import collective_ready
from modelpar.checkpoint._agree import agree
from modelpar.checkpoint._pipeline import is_pipelined
from modelpar.checkpoint._progress import Progress
from modelpar.checkpoint._remote import RemotePath, to_location, upload
from modelpar.hf._experts import save_layout, split_for_save
from modelpar.hf._files import Entry, parse_size
from modelpar.hf._folder import FolderExport, check_destination, check_dtype_argument, configured, out_dtype
from modelpar.hf._keys import model_tensors, unwrap

__all__ = ["save_pretrained"]


def save_pretrained(
    model: Any,
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    progress: bool = False,
) -> None:
    """Save ``model`` (a Hugging Face ``PreTrainedModel``, sharded or not) to the folder ``path`` in its format.

    Collective: call it on every rank. Tensors are gathered one at a time and written by rank 0 into
    ``model.safetensors``, or files of at most ``max_shard_size`` (``"5GB"`` is 5e9 bytes, as Hugging Face
    counts; or an int) with ``model.safetensors.index.json``; then ``config.json`` and, for models that
    generate, ``generation_config.json``. Tied weights are written once, under their first name (as
    ``save_pretrained`` does), and ``from_pretrained`` ties them again. Fused mixture-of-experts tensors are
    written per expert where transformers writes them so for the family (Qwen3-MoE, Mixtral ...). ``dtype``
    casts the floating-point tensors (and sets the config's ``dtype``).

    Memory: one full tensor at a time beyond the shards, on every rank. The folder appears at ``path`` only
    when complete; an earlier export there is replaced, keeping files it does not write (a tokenizer). A
    folder holding anything else is refused (``IsADirectoryError``). ``progress``: a progress line on
    rank 0's stderr. ``path`` may be a URL (``s3://`` ...): rank 0 then writes the folder locally and uploads
    it, ``config.json`` last.
    """
    module = unwrap(model)
    target = to_location(path)
    if is_pipelined(module):
        _save_pipelined(module, target, max_shard_size, dtype, progress)
        return
    upload_to = target if isinstance(target, RemotePath) else None
    with tempfile.TemporaryDirectory(prefix="modelpar-hf-") if upload_to else contextlib.nullcontext("") as tmp:
        dst = Path(tmp) / upload_to.name if upload_to else cast(Path, target)
        _save(module, dst, upload_to, max_shard_size, dtype, progress)


def _config(module: Any) -> Any:
    """The model's Hugging Face config, written beside its weights; ``TypeError`` for a model without one."""
    config = getattr(module, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        raise TypeError(
            f"{type(module).__name__} has no Hugging Face `config` to save beside its weights. Pass a"
            " `PreTrainedModel` (e.g. from `AutoModelForCausalLM.from_config`)."
        )
    return config


def _save_pipelined(module: Any, target: Any, max_shard_size: int | str, dtype: Any, progress: bool) -> None:
    """A pipelined model: rank 0 holds only its stages, so every rank writes its shards as a distributed checkpoint
    beside ``target`` (``<target>.stages``), and rank 0 exports that folder (:func:`export_checkpoint`, the code
    of ``modelpar convert --to hf``: tensor by tensor, about twice the largest tensor in memory); then the staging
    folder is removed. ``target`` may be a URL: the checkpoint is then staged there, beside it, too."""
    from modelpar.checkpoint import Checkpointer
    from modelpar.hf._export import export_checkpoint

    check_dtype_argument(dtype)
    config = _config(module)
    staging = to_location(f"{target}.stages")
    Checkpointer().save(staging, {"model": module}, full=False)
    error: Exception | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            export_checkpoint(
                staging,  # type: ignore[arg-type]  # a RemotePath where the target is a URL, as export itself passes
                target,
                config=config,
                max_shard_size=max_shard_size,
                dtype=dtype,
                overwrite=True,
                progress=progress,
            )
        except Exception as err:  # raised on every rank below
            error = err
        finally:
            if isinstance(staging, RemotePath):
                staging.remove()
            else:
                shutil.rmtree(staging, ignore_errors=True)
    agree(f"Exporting the pipelined model to {str(target)!r}", error)


def _save(
    module: Any, dst: Path, upload_to: RemotePath | None, max_shard_size: int | str, dtype: Any, progress: bool
) -> None:
    """:func:`save_pretrained` into the local folder ``dst``, then (rank 0) uploaded to ``upload_to`` if given."""
    max_bytes = parse_size(max_shard_size)
    check_dtype_argument(dtype)
    config = _config(module)
    check_destination(dst, overwrite=True)
    ours = model_tensors(module)
    tensors = [ours.tensors[name] for name in ours.unique]
    # Each tensor's file tensors: itself, or one per expert (and gate/up) where the family's folders hold them so.
    layout = save_layout(module)
    pieces = [split_for_save(name, tuple(t.shape), layout) for name, t in zip(ours.unique, tensors, strict=True)]
    entries = [
        Entry(file_name, shape, out_dtype(t.dtype, dtype))
        for cuts, t in zip(pieces, tensors, strict=True)
        for file_name, shape, _ in cuts
    ]
    writing = not dist.is_initialized() or dist.get_rank() == 0
    export = FolderExport(dst, entries, max_bytes) if writing else None
    error: Exception | None = None
    if export is not None:
        try:
            export.begin()
        except Exception as err:
            error = err
    agree(f"Preparing the export to {str(dst)!r}", error)
    bar = Progress(progress and writing, len(entries), sum(e.nbytes for e in entries))
    for cuts, tensor in zip(pieces, tensors, strict=True):
        # A collective on every rank, on the mesh's device: CPU-offloaded shards are copied there first.
        full = collective_ready(tensor).full_tensor() if isinstance(tensor, DTensor) else tensor
        for _, shape, cut in cuts:
            if export is not None and error is None:
                try:
                    export.write(cut(full.detach()))
                except Exception as err:  # keep gathering, so the other ranks are not left waiting
                    error = err
            bar.advance(Entry("", shape, out_dtype(tensor.dtype, dtype)).nbytes)
        del full
    if export is not None:
        try:
            if error is None:
                total = sum(t.numel() for t in tensors if isinstance(t, torch.nn.Parameter))
                export.finish(total, lambda folder: _save_configs(module, config, entries, folder))
                if upload_to is not None:
                    upload(dst, upload_to, markers=False)  # config.json last: a cut-off upload does not load
        except Exception as err:
            error = err
        if error is not None:
            export.abort()
    agree(f"Exporting the model to {str(upload_to or dst)!r}", error)
    if writing:
        bar.finish(dst)


def _save_configs(module: Any, config: Any, entries: list[Entry], folder: Path) -> None:
    configured(config, type(module).__name__, entries).save_pretrained(folder)
    can_generate = getattr(module, "can_generate", None)
    generation_config = getattr(module, "generation_config", None)
    if callable(can_generate) and can_generate() and generation_config is not None:
        generation_config.save_pretrained(folder)
