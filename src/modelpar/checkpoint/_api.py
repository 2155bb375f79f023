"""Checkpoints without a strategy: ``save_state`` / ``load_state`` for standalone scripts and tools.

Both are collective when a process group exists (call them on every rank) and work in a single process
without one. They save synchronously; for background saves hold a :class:`Checkpointer` yourself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from modelpar.checkpoint._checkpointer import Checkpointer
from modelpar.checkpoint._state import FilterFns

__all__ = ["load_state", "save_state"]


def save_state(
    path: str | Path,
    state: Mapping[str, Any],
    *,
    full: bool,
    filter: FilterFns | None = None,
    known_modules: Sequence[nn.Module] = (),
) -> None:
    """Save models, optimizers and metadata in ``state`` to ``path`` (atomically).

    ``known_modules``: models set up elsewhere (by a strategy) that an optimizer in ``state`` may belong to.
    """
    checkpointer = Checkpointer()
    try:
        checkpointer.save(path, state, full=full, filter=filter, known_modules=known_modules)
    finally:
        checkpointer.close()  # the previous checkpoint at ``path`` is deleted when this returns


def load_state(
    path: str | Path,
    state: dict[str, Any],
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    known_modules: Sequence[nn.Module] = (),
) -> dict[str, Any]:
    """Restore ``state`` from ``path`` (models, optimizers and stateful objects in place); return the rest.

    ``weights_only`` (``None`` means torch's default, ``True``) governs every unpickling of the load: the
    metadata, a full file's top level, and a folder's ``.metadata`` and non-tensor entries (restricted to
    what DCP writes there); anything else raises ``WeightsOnlyError``. Pass ``False`` only for checkpoints
    you trust.
    """
    return Checkpointer().load(path, state, strict=strict, weights_only=weights_only, known_modules=known_modules)
