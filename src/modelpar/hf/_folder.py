"""Writing a Hugging Face model folder atomically: staged beside the destination, committed by a rename.

Weights go through :class:`~modelpar.hf._files.ShardWriter`, one tensor at a time; ``config.json`` and
``generation_config.json`` through the configs' own ``save_pretrained``. The folder appears at its path only
when complete (:mod:`modelpar.checkpoint._commit`: ``fsync``, rename, ``fsync`` the parent). Replacing an
earlier export keeps the files of it that an export does not write (a tokenizer saved beside the weights).
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from modelpar.checkpoint._commit import commit, new_token, remove_stale, staging_path
from modelpar.hf._files import Entry, ShardWriter, is_pretrained_folder, is_weight_file, plan_shards

__all__ = ["FolderExport", "check_destination", "check_dtype_argument", "configured", "out_dtype"]

_CONFIG_FILES = ("config.json", "generation_config.json")


def check_destination(dst: Path, *, overwrite: bool) -> None:
    """Refuse a destination that is in the way: a file, a folder that is not a model folder, or (unless
    ``overwrite``) an earlier export."""
    if not (dst.exists() or dst.is_symlink()):
        return
    if not dst.is_dir():
        raise FileExistsError(
            f"{str(dst)!r} is a file; a pretrained model is a folder. Choose another path, or remove the file."
        )
    if is_pretrained_folder(dst):
        if not overwrite:
            raise FileExistsError(
                f"The destination {str(dst)!r} already holds a pretrained model. Pass `overwrite=True`"
                " (`--overwrite` on the command line) to replace it, or choose another path."
            )
        return
    if any(dst.iterdir()):
        raise IsADirectoryError(
            f"Refusing to write into {str(dst)!r}: it is a folder with other files and no pretrained model"
            " (`config.json` and safetensors weights). Choose a new or empty folder."
        )


def out_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor is written in: ``dtype`` for floating-point tensors, its own otherwise."""
    return dtype if dtype is not None and saved.is_floating_point else saved


def check_dtype_argument(dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(
            f"`dtype={dtype!r}` is not a floating-point torch dtype. Pass e.g. `torch.bfloat16`, or None to keep the"
            " model's dtypes."
        )


def configured(config: Any, architecture: str, entries: Sequence[Entry]) -> Any:
    """A copy of ``config`` naming the class and dtype of the weights written, as ``save_pretrained`` does."""
    config = copy.deepcopy(config)
    config.architectures = [architecture.removeprefix("FSDP")]  # FSDP2 renames the class FSDP<name>
    floating = next((e.dtype for e in entries if e.dtype.is_floating_point), None)
    if floating is not None:
        config.dtype = str(floating).removeprefix("torch.")
    return config


class FolderExport:
    """One export on the writing process: ``begin()``, ``write()`` each entry's tensor in order, ``finish()``.

    ``abort()`` removes the staging folder after a failure (the destination is untouched).
    """

    def __init__(self, dst: Path, entries: Sequence[Entry], max_bytes: int) -> None:
        self.dst = dst
        self._shards = plan_shards(entries, max_bytes)
        self._token = new_token()
        self._staged = staging_path(dst, self._token)
        self._writer: ShardWriter | None = None

    def begin(self) -> None:
        self.dst.parent.mkdir(parents=True, exist_ok=True)
        remove_stale(self.dst)
        self._staged.mkdir()
        self._writer = ShardWriter(self._staged, self._shards)

    def write(self, tensor: torch.Tensor) -> None:
        assert self._writer is not None
        self._writer.write(tensor)

    def finish(self, total_parameters: int, save_configs: Callable[[Path], None]) -> None:
        assert self._writer is not None
        self._writer.close(total_parameters)
        save_configs(self._staged)
        if self.dst.is_dir():  # an earlier export: keep what we do not write (a tokenizer ...)
            for entry in self.dst.iterdir():
                if entry.name in _CONFIG_FILES or is_weight_file(entry.name) or (self._staged / entry.name).exists():
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.copytree(entry, self._staged / entry.name, symlinks=True)
                else:
                    shutil.copy2(entry, self._staged / entry.name, follow_symlinks=False)
        commit(self.dst, self._staged, self._token)

    def abort(self) -> None:
        shutil.rmtree(self._staged, ignore_errors=True)
