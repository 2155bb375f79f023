"""The two entry points the strategies use: ``save_state`` and ``load_state`` on a user state dict."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from modelpar.checkpoint import _io
from modelpar.checkpoint._state import FilterFns, split_state

__all__ = ["load_state", "save_state"]


def save_state(
    path: str | Path,
    state: Mapping[str, Any],
    *,
    full: bool,
    filter: FilterFns | None = None,
    known_modules: Sequence[nn.Module] = (),
) -> None:
    """Save models, optimizers and metadata in ``state`` to ``path``; collective, call on every rank.

    ``known_modules``: models set up elsewhere (by a strategy) that an optimizer in ``state`` may belong to.
    """
    _io.save(Path(path), split_state(state, known_modules), full=full, filters=filter)


def load_state(
    path: str | Path,
    state: dict[str, Any],
    *,
    strict: bool = True,
    weights_only: bool | None = None,
    known_modules: Sequence[nn.Module] = (),
) -> dict[str, Any]:
    """Restore ``state`` from ``path`` (models, optimizers and stateful objects in place); return the rest.

    ``weights_only`` goes to ``torch.load`` for the metadata: ``None`` means torch's default (``True``),
    which refuses arbitrary pickled objects; pass ``False`` only for checkpoints you trust.
    """
    return _io.load(Path(path), split_state(state, known_modules), state, strict=strict, weights_only=weights_only)
