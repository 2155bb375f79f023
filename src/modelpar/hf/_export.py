"""A distributed checkpoint folder exported as a Hugging Face pretrained folder, offline and in one process.

The model's names, shapes and ties come from its config: the model is built on the meta device (no
memory), and its state dict is compared with the checkpoint's metadata before anything is read. Then each
tensor is read from the DCP folder on its own (``.metadata`` read once, no process group) and written into
its safetensors file, so memory stays near the largest tensor whatever the model size.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from modelpar._errors import CheckpointKeyError, CorruptCheckpointError, WeightsOnlyError
from modelpar.checkpoint._dcp_read import CachedReader, read_local, root_cause
from modelpar.checkpoint._format import CheckpointFormat
from modelpar.checkpoint._inspect import read_dcp_metadata
from modelpar.checkpoint._io import detect
from modelpar.checkpoint._names import clean_name
from modelpar.checkpoint._progress import Progress
from modelpar.checkpoint._remote import Location, RemotePath, staged_upload, to_location
from modelpar.checkpoint._stream import check_shapes
from modelpar.hf._experts import save_layout, split_for_save
from modelpar.hf._files import Entry, parse_size
from modelpar.hf._folder import FolderExport, check_destination, check_dtype_argument, configured, out_dtype
from modelpar.hf._keys import map_file_keys, model_tensors

__all__ = ["export_checkpoint"]


def export_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    config: Any,
    key: str = "model",
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    progress: bool = True,
    weights_only: bool | None = None,
) -> None:
    """Export the model state ``key`` of the distributed checkpoint folder ``src`` as the pretrained folder ``dst``.

    ``config``: the model's Hugging Face config, as a folder holding ``config.json`` (a pretrained folder) or a
    ``PretrainedConfig``. The model class is the config's ``architectures[0]``, else ``AutoModelForCausalLM``.
    Its tensors must match the checkpoint's names and shapes (:class:`~modelpar.CheckpointKeyError`,
    :class:`~modelpar.CheckpointShapeError`); tied weights are written once, and fused mixture-of-experts
    tensors per expert where the family's folders hold them so, as ``save_pretrained`` does. ``dtype`` casts
    the floating-point tensors. ``generation_config.json`` is copied from the config folder, or written for
    models that generate. Other arguments as in :func:`~modelpar.checkpoint.convert_to_file`.
    One process, no process group; memory about twice the largest tensor. ``src`` and ``dst`` may be URLs
    (``s3://`` ...): the folder is then written locally and uploaded, ``config.json`` last.
    """
    src_path, dst_loc = to_location(src), to_location(dst)
    if isinstance(dst_loc, RemotePath):
        if dst_loc.exists() and not overwrite:
            raise FileExistsError(f"{str(dst_loc)!r} exists already. Pass `overwrite=True` to replace what is there.")
        with staged_upload(dst_loc, markers=False) as local:
            export_checkpoint(
                src_path,  # type: ignore[arg-type]
                local,
                config=config,
                key=key,
                max_shard_size=max_shard_size,
                dtype=dtype,
                overwrite=True,
                progress=progress,
                weights_only=weights_only,
            )
        return
    dst_path = dst_loc
    if detect(src_path) is not CheckpointFormat.DISTRIBUTED:
        raise ValueError(
            f"{str(src_path)!r} is a full checkpoint file; `export_checkpoint` reads a distributed checkpoint folder."
            f" Convert it first: `modelpar convert {src_path} FOLDER --to distributed`."
        )
    max_bytes = parse_size(max_shard_size)
    check_dtype_argument(dtype)
    check_destination(dst_path, overwrite=overwrite)
    hf_config, config_folder = _read_config(config)
    model = _meta_model(hf_config)
    ours = model_tensors(model)

    metadata = read_dcp_metadata(src_path, weights_only=weights_only)
    saved = _model_items(metadata, key, src_path)  # clean name -> (DCP key, shape, dtype)
    where = f"the checkpoint {str(src_path)!r} (entry {key!r})"
    to_model = map_file_keys(saved, ours.tensors, getattr(model, "base_model_prefix", "") or "")
    from_saved = {name: saved_name for saved_name, name in to_model.items()}
    unexpected = [k for k, name in to_model.items() if name not in ours.tensors]
    sources = {first: next((n for n in names if n in from_saved), None) for first, names in ours.aliases.items()}
    missing = [first for first, source in sources.items() if source is None]
    if missing or unexpected:
        raise CheckpointKeyError(
            f"The model state in {where} does not match {type(model).__name__} built from the config:"
            f" {len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]})."
            " Pass the config of the model that was trained."
        )
    picked = {first: saved[from_saved[source]] for first, source in sources.items() if source is not None}
    check_shapes({first: ours.tensors[first] for first in picked}, {k: v[1] for k, v in picked.items()}, where)

    # Each tensor's file tensors: itself, or one per expert (and gate/up) where the family's folders hold them so.
    layout = save_layout(model)
    pieces = [split_for_save(first, tuple(shape), layout) for first, (_, shape, _) in picked.items()]
    entries = [
        Entry(file_name, cut_shape, out_dtype(saved_dtype, dtype))
        for cuts, (_, _, saved_dtype) in zip(pieces, picked.values(), strict=True)
        for file_name, cut_shape, _ in cuts
    ]
    reader = CachedReader(src_path, metadata, weights_only=weights_only)
    bar = Progress(progress, len(entries), sum(e.nbytes for e in entries))
    export = FolderExport(dst_path, entries, max_bytes)
    export.begin()
    try:
        for cuts, (dcp_key, shape, saved_dtype) in zip(pieces, picked.values(), strict=True):
            tensor = torch.empty(shape, dtype=saved_dtype)
            _read(dcp_key, tensor, reader, src_path)
            for _, cut_shape, cut in cuts:
                export.write(cut(tensor))
                bar.advance(Entry("", cut_shape, out_dtype(saved_dtype, dtype)).nbytes)
            del tensor
        total = sum(p.numel() for p in model.parameters())
        export.finish(total, lambda folder: _save_configs(model, hf_config, config_folder, entries, folder))
    except BaseException:
        export.abort()
        raise
    bar.finish(dst_path)


def _read_config(config: Any) -> tuple[Any, Path | None]:
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config, None
    if isinstance(config, (str, os.PathLike)):
        folder = Path(config)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"No 'config.json' in {str(folder)!r}. Pass the folder of the pretrained model the training started"
                " from, or a `PretrainedConfig`."
            )
        return AutoConfig.from_pretrained(folder), folder
    raise TypeError(
        f"`config` must be a folder with 'config.json' or a `PretrainedConfig`, not {type(config).__name__}."
    )


def _meta_model(config: Any) -> Any:
    """The config's model on the meta device: its names, shapes and ties, without memory."""
    import transformers

    architectures = getattr(config, "architectures", None) or []
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    with torch.device("meta"):
        if model_class is not None:
            return model_class(config)
        return transformers.AutoModelForCausalLM.from_config(config)


def _model_items(metadata: Any, key: str, src: Location) -> dict[str, tuple[str, torch.Size, torch.dtype]]:
    planner_data = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    items: dict[str, tuple[str, torch.Size, torch.dtype]] = {}
    tops: set[str] = set()
    for dcp_key, meta in metadata.state_dict_metadata.items():
        path: tuple[Any, ...] = tuple(planner_data.get(dcp_key) or (dcp_key,))
        tops.add(str(path[0]))
        if str(path[0]) == key and len(path) == 2 and isinstance(meta, TensorStorageMetadata):
            items[clean_name(str(path[1]))] = (dcp_key, meta.size, meta.properties.dtype)
    if not items:
        raise ValueError(
            f"The checkpoint {str(src)!r} has no model state dict under {key!r}; its entries are {sorted(tops)}."
            " Pass the entry that holds the model (`key=`)."
        )
    return items


def _read(dcp_key: str, tensor: torch.Tensor, reader: CachedReader, src: Location) -> None:
    try:
        read_local({dcp_key: tensor}, reader, partial=False)
    except (Exception, dcp.CheckpointException) as err:  # DCP wraps read errors in a BaseException subclass
        if isinstance(cause := root_cause(err), WeightsOnlyError):
            raise cause from err
        raise CorruptCheckpointError(
            f"Reading {dcp_key!r} from the checkpoint {str(src)!r} failed: it is truncated or corrupt"
            f" ({type(err).__name__}: {err})."
        ) from err


def _save_configs(model: Any, config: Any, config_folder: Path | None, entries: list[Entry], folder: Path) -> None:
    configured(config, type(model).__name__, entries).save_pretrained(folder)
    if config_folder is not None and (config_folder / "generation_config.json").is_file():
        shutil.copy2(config_folder / "generation_config.json", folder / "generation_config.json")
    elif model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
