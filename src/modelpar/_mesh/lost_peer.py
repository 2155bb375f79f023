"""What a rank leaves behind when a peer is lost: the message it prints before the watchdog ends it, the line
that names the likely cause after an uncaught error's traceback, and torchrun's error file.

The watchdog (:mod:`.watchdog`) decides that a peer is lost; this is how the loss reads to the user, on every path
the process can end by (the watchdog's own exit, an exception a collective raised meanwhile, a torchrun summary).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from types import TracebackType
from typing import Any, Protocol

__all__ = ["PEER_LOST_EXIT_CODE", "Diagnosing", "hook_in", "hook_out", "lost_peer_message", "record_for_torchrun"]

#: Exit status of a process the watchdog ends: ``EX_TEMPFAIL`` ("temporary failure, try again"), as restarting the
#: job and resuming from the last checkpoint is the remedy, and distinct from a crash's 1 or a signal's negative code.
PEER_LOST_EXIT_CODE = 75


class Diagnosing(Protocol):
    """A running watchdog, as the excepthook asks it: this rank, and the lost peer that explains an error, if any."""

    rank: int

    def diagnose(self) -> str | None: ...


def lost_peer_message(*, rank: int, what: str, peer_timeout: float, reported_by: int | None = None) -> str:
    """The error a rank prints before the watchdog ends it: who is lost, why this rank stops, what to do."""
    source = f"rank {reported_by} found that " if reported_by is not None and reported_by != rank else ""
    return (
        f"modelpar: ending rank {rank} (exit code {PEER_LOST_EXIT_CODE}) because {source}{what}. The other ranks"
        " would otherwise wait in their next collective until the process-group timeout. Find why it stopped in"
        " its own log, and for a SIGKILL in the kernel log (`dmesg`: the OOM killer), then restart the job (e.g."
        " `torchrun --max-restarts`) and resume from the last checkpoint. Bound: the strategy's"
        f" `peer_timeout={peer_timeout:g}` seconds (None turns this watchdog off)."
    )


_running: list[Diagnosing] = []  # the started, not yet stopped watchdogs of this process (usually one)
_previous_hook: Any = None


def hook_in(watchdog: Diagnosing) -> None:
    """Install :func:`_report_lost_peer` as ``sys.excepthook`` while a watchdog runs (once, chained)."""
    global _previous_hook
    _running.append(watchdog)
    if sys.excepthook is not _report_lost_peer:
        _previous_hook, sys.excepthook = sys.excepthook, _report_lost_peer


def hook_out(watchdog: Diagnosing) -> None:
    if watchdog in _running:
        _running.remove(watchdog)
    if not _running and sys.excepthook is _report_lost_peer:
        sys.excepthook = _previous_hook


def _report_lost_peer(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
    """After the traceback of an uncaught error, name the process whose death most likely caused it, if found."""
    (_previous_hook or sys.__excepthook__)(kind, error, trace)
    for watchdog in list(_running):
        found = watchdog.diagnose() if not isinstance(error, KeyboardInterrupt) else None
        if found is not None:
            print(
                f"modelpar: rank {watchdog.rank} failed with the error above, most likely because {found}. Find why"
                " in that process's log (for a SIGKILL: `dmesg`, the OOM killer), then restart the job and resume"
                " from the last checkpoint.",
                file=sys.stderr,
                flush=True,
            )


def record_for_torchrun(message: str) -> None:
    """Under torchrun, leave the message where its failure summary shows it (``TORCHELASTIC_ERROR_FILE``): the
    root cause then reads as this message instead of a bare exit code."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        with contextlib.suppress(OSError), open(path, "w") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
