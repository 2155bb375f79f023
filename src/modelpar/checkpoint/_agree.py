"""Agreeing on an outcome: a failure on one rank becomes the same error on every rank, at once.

A step that only some ranks run (rank 0 writes the full file and commits) or that can fail on some ranks
only (a full disk, a quota, a read-only folder on one node) is followed by one small collective: every rank
contributes ``None`` or ``(type name, errno, message)`` and the host it runs on. If any rank failed, every
rank raises: the failing rank its own exception, the others the same type where it is a built-in ``OSError``
subclass (``PermissionError``, ``OSError`` for ENOSPC ...), else a ``RuntimeError``, naming the rank and the
original error. Without it, the other ranks would wait in their next collective until the process-group
timeout (30 minutes by default). Without a process group, errors are raised as they come.
"""

from __future__ import annotations

import builtins
import os
import socket
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

__all__ = ["agree", "gather", "node_leader", "not_shared_error", "run_agreed"]

Summary = tuple[str, int | None, str]


def summarize(error: BaseException) -> Summary:
    """What the other ranks learn of ``error``: its type name, errno (if any) and first line of message."""
    lines = str(error).splitlines()
    return type(error).__name__, getattr(error, "errno", None), lines[0] if lines else ""


def gather(value: Any, group: Any = None) -> list[tuple[Any, str]]:
    """Every rank's ``(value, host name)``, by rank (a collective); just this one without a process group."""
    mine = (value, socket.gethostname())
    if not dist.is_initialized():
        return [mine]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return everyone


def agree(what: str, error: BaseException | None = None, *, value: Any = None, group: Any = None) -> list[Any]:
    """Collective: every rank's ``value``, by rank; or, if ``error`` is set on any rank, raise on every rank.

    ``what`` says what was done, for the message: ``"Writing the checkpoint '/ckpt'"``.
    """
    if not dist.is_initialized():
        if error is not None:
            raise error
        return [value]
    outcomes = gather((summarize(error) if error is not None else None, value), group)
    failed = [(rank, outcome[0], host) for rank, (outcome, host) in enumerate(outcomes) if outcome[0] is not None]
    if not failed:
        return [outcome[1] for outcome, _ in outcomes]
    if error is not None:
        raise error
    rank, (name, errno, message), host = failed[0]
    more = f" (and on {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    text = f"{what} failed on rank {rank} (host {host}){more}: {name}: {message}"
    kind = getattr(builtins, name, None)
    if isinstance(kind, type) and issubclass(kind, OSError):
        raised = kind(text)
        raised.errno = errno
        raise raised
    raise RuntimeError(text)


def run_agreed(what: str, job: Callable[[], Any], *, here: bool = True, group: Any = None) -> list[Any]:
    """Run ``job`` where ``here`` (e.g. ``rank == 0``), then :func:`agree` on the outcome; its values by rank."""
    value, error = None, None
    if here:
        try:
            value = job()
        except Exception as err:  # BaseExceptions (KeyboardInterrupt ...) are not about the checkpoint
            error = err
    return agree(what, error, value=value, group=group)


def node_leader() -> bool:
    """Whether this process is the first on its node (``LOCAL_RANK`` 0); ``True`` where unknown."""
    local = os.environ.get("LOCAL_RANK")
    return local is None or not local.strip().isdigit() or int(local) == 0


def not_shared_error(path: Any, views: list[tuple[Any, str]], action: str) -> RuntimeError:
    """The error for a path that the processes see differently: ``views`` is :func:`gather`'s answer."""
    by_view: dict[str, list[str]] = {}
    for rank, (view, host) in enumerate(views):
        by_view.setdefault(str(view), []).append(f"{rank} ({host})")
    seen = "; ".join(f"rank(s) {', '.join(ranks)} see {view}" for view, ranks in by_view.items())
    return RuntimeError(
        f"Cannot {action} {str(path)!r}: the path is not shared by all processes ({seen}). Every process must see"
        " the same folder: put checkpoints on a file system shared by all nodes (not a node-local disk), or"
        " wait until the file system shows every node the same content."
    )
