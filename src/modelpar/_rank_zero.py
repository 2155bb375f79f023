"""Messages from global rank 0 only, through Lightning's own helpers, imported when the first message is sent.

Lightning's ``rank_zero_warn`` / ``rank_zero_info`` are the channel users already filter and configure (its
``lightning_fabric.utilities.rank_zero`` logger, its per-rank gate), so modelpar keeps using them. But importing
anything under ``lightning_fabric`` imports the whole package (its ``__init__`` loads Fabric, torchmetrics and,
through them, transformers and ``torch._dynamo``: about 2.5 s of CPU). The parts of modelpar that work without
Lightning (checkpoints, the memory estimate, the ``modelpar`` command line) call these instead, so they pay that
only where a message is actually sent, and a process that never trains never pays it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["rank_zero_info", "rank_zero_warn"]


def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """Lightning's ``rank_zero_warn``: a warning on global rank 0; the default points at the same frame as
    Lightning's (one more frame here)."""
    from lightning_fabric.utilities.rank_zero import rank_zero_warn as warn

    warn(message, stacklevel=stacklevel + 1, **kwargs)


def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """Lightning's ``rank_zero_info``: a log record on global rank 0, from Lightning's rank-zero logger."""
    from lightning_fabric.utilities.rank_zero import rank_zero_info as info

    info(*args, stacklevel=stacklevel + 1, **kwargs)
