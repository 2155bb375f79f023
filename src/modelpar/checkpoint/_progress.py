"""A dependency-free progress line for long offline conversions (stderr; live only on a terminal)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from modelpar.checkpoint._inspect import format_size

__all__ = ["Progress"]


class Progress:
    """``done/total tensors, bytes done`` on one updating stderr line (TTY only), then one summary line."""

    def __init__(self, enabled: bool, total: int, total_bytes: int) -> None:
        self._stream = sys.stderr
        self._enabled = enabled and self._stream is not None
        self._live = self._enabled and self._stream.isatty()
        self._total, self._total_bytes = total, total_bytes
        self._done = self._done_bytes = 0
        self._start = self._shown = time.monotonic()

    def advance(self, nbytes: int) -> None:
        self._done, self._done_bytes = self._done + 1, self._done_bytes + nbytes
        now = time.monotonic()
        if self._live and (now - self._shown >= 0.1 or self._done >= self._total):
            self._shown = now
            self._stream.write(
                f"\r{min(self._done, self._total)}/{self._total} tensors,"
                f" {format_size(self._done_bytes)} of {format_size(self._total_bytes)}"
            )
            self._stream.flush()

    def finish(self, dst: Path) -> None:
        if not self._enabled:
            return
        seconds = time.monotonic() - self._start
        end_live_line = "\n" if self._live else ""
        self._stream.write(
            f"{end_live_line}converted {self._total} tensors ({format_size(self._total_bytes)}) into {str(dst)!r}"
            f" in {seconds:.1f} s\n"
        )
        self._stream.flush()
