"""Reading the pickles inside a DCP folder without running arbitrary code: ``weights_only`` for DCP.

DCP reads ``.metadata`` with ``pickle.load`` and every non-tensor value (an optimizer's ``param_groups``,
anything saved as a ``BYTE_IO`` item) with ``torch.load(weights_only=False)``, whatever the caller asked
for. A crafted folder can so run code on load. With ``weights_only`` true (or ``None``: torch's default,
true) modelpar reads them here instead:

* ``.metadata`` with an unpickler that admits only the classes DCP writes into it (:data:`METADATA_GLOBALS`,
  plus torch's dtypes, layouts and memory formats): found by tracing ``find_class`` over real saves of
  models, AdamW state, DTensors and nested non-tensor values.
* byte entries, which DCP writes with ``torch.save``, with torch's own safe loader
  (``torch.load(weights_only=True)``, which also admits what ``torch.serialization.add_safe_globals`` allows).

A refused object raises :class:`~modelpar._errors.WeightsOnlyError` naming it, the file and the fix.
"""

from __future__ import annotations

import io
import pickle
import re
from typing import IO, Any

import torch

from modelpar._errors import WeightsOnlyError

__all__ = ["METADATA_GLOBALS", "check_bytes", "load_metadata", "refused_global"]

#: Every global a ``.metadata`` pickle names, by module. Calling any of them builds data, nothing else:
#: dataclasses and an enum of DCP, ``torch.Size``, ``_get_layout`` (a name -> ``torch.layout`` lookup) and
#: the path DCP records as ``storage_meta.checkpoint_id``.
METADATA_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),  # and every dtype, layout and memory format: see _is_torch_constant
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),
    "pathlib._local": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"}),  # Python 3.13
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}

_FIX = "Pass `weights_only=False` if you trust the checkpoint"


def _is_torch_constant(module: str, name: str) -> bool:
    """``torch.float32``, ``torch.strided``, ``torch.contiguous_format``...: values, not callables."""
    value = getattr(torch, name, None) if module == "torch" else None
    return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: IO[bytes], where: str) -> None:
        super().__init__(file)
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()) or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise WeightsOnlyError(
            f"The checkpoint file {self._where!r} holds `{module}.{name}`, which loading with `weights_only=True`"
            " (the default) refuses to unpickle: DCP's metadata holds only its own dataclasses, torch sizes and"
            f" dtypes, so the file was not written by DCP alone. {_FIX} (`weights_only=False` reads it with"
            " `pickle.load`, as DCP does)."
        )


def load_metadata(file: IO[bytes], where: str) -> Any:
    """Unpickle a DCP ``.metadata`` file admitting only :data:`METADATA_GLOBALS`; ``where`` names the file."""
    return _MetadataUnpickler(file, where).load()


def refused_global(err: BaseException) -> str:
    """The global that torch's safe loader refused, from its message: "`pathlib.Path.touch`" or a fallback."""
    refused = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(err))
    return f"`{refused.group(1)}`" if refused else "a custom object"


def check_bytes(value: io.BytesIO, where: str) -> None:
    """Raise :class:`WeightsOnlyError` unless torch's safe loader accepts the ``torch.save``'d ``value``.

    ``value`` is rewound afterwards, for DCP's planner to read it again (it reads with ``weights_only=False``,
    which, for a pickle whose every global the safe loader accepted, builds the same objects).
    """
    try:
        torch.load(value, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise WeightsOnlyError(
            f"The checkpoint entry {where} holds {refused_global(err)}, which loading with `weights_only=True`"
            f" (the default) refuses to unpickle. {_FIX}, or allow the class with"
            " `torch.serialization.add_safe_globals([...])`."
        ) from err
    finally:
        value.seek(0)
