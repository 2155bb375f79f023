"""Reaching and recognising the job's other processes, for the peer watchdog (``modelpar._mesh.watchdog``).

Two mechanisms the watchdog's decisions rest on: store requests that cannot hang the caller, and where a rank's
process runs, so that a process on the same machine can be seen to have exited without asking anyone.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["RankProcess", "StoreCall", "parse_neighbours"]


class _RequestThread(threading.Thread):
    """A store request's daemon thread, with the ``stop()`` that test suites' leftover-thread checks call on daemon
    threads (Lightning's fails a test on a daemon thread without one): a request cannot be interrupted, so
    ``stop()`` waits a bounded time for it to return; a heartbeat left in flight when a test ends returns at once.
    """

    def __init__(self, run: Callable[[Callable[[], Any]], None], fn: Callable[[], Any]) -> None:
        super().__init__(target=run, args=(fn,), name="modelpar-store-request", daemon=True)

    def stop(self, timeout: float = 5.0) -> None:
        if self is not threading.current_thread():
            self.join(timeout)


class StoreCall:
    """One store request on its own daemon thread, so that the watchdog can judge while it waits.

    A c10d store client's timeout covers waiting for keys, not a store host that stops reading: against a frozen
    host (or one whose network is gone) a request blocks for good. Daemon threads never hold up the exit.

    But a daemon thread whose request *returns* while the interpreter is finalizing is ended by Python inside
    pybind11's GIL guard, a C++ destructor, and the process aborts ("terminate called without an active
    exception"). So the watchdog :meth:`drain`-s the requests in flight when it stops, before finalization;
    only a request to a store that never answers again can outlive that, and it never returns.
    """

    _live: ClassVar[set[StoreCall]] = set()
    _lock = threading.Lock()

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.finished = 0.0  # monotonic time of the answer
        self._thread = _RequestThread(self._run, fn)
        # Started, then registered, under one lock: `drain` (another thread's `stop`) must never see a thread that
        # has not started, which `join` refuses (RuntimeError), nor one whose start failed. `start` only waits for
        # the thread to begin, and `_run` takes the lock after its request, so holding it here cannot deadlock.
        with StoreCall._lock:
            self._thread.start()
            StoreCall._live.add(self)

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as error:  # handed to whoever waits
            self.error = error
        self.finished = time.monotonic()
        with StoreCall._lock:
            StoreCall._live.discard(self)

    @classmethod
    def drain(cls, timeout: float) -> None:
        """Wait up to ``timeout`` in all for the requests in flight to return (see the class docstring)."""
        deadline = time.monotonic() + timeout
        with cls._lock:
            live = list(cls._live)
        for call in live:
            call._thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the c10d store did not answer within {timeout:g} s")
        if self.error is not None:
            raise self.error
        return self.result


@dataclass(frozen=True)
class RankProcess:
    """Where a rank runs, as it published itself: for messages and the same-host liveness check."""

    host: str
    pid: int
    machine: str  # host name and PID namespace: equal means the PID can be checked from here

    def encode(self) -> str:
        return f"{self.host}\t{self.pid}\t{self.machine}"

    @classmethod
    def decode(cls, text: str) -> RankProcess | None:
        parts = text.split("\t")
        return cls(parts[0], int(parts[1]), parts[2]) if len(parts) == 3 and parts[1].isdigit() else None

    @classmethod
    def this(cls) -> RankProcess:
        host = socket.gethostname()
        try:
            namespace = str(os.stat("/proc/self/ns/pid").st_ino)
        except OSError:  # no /proc (macOS, Windows): PIDs are never checked across processes then
            namespace = f"pid{os.getpid()}"
        return cls(host, os.getpid(), f"{host}/{namespace}")

    def gone(self) -> bool:
        """Whether this process has ended; only meaningful when it runs on this machine (same ``machine``)."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # exited, not yet reaped
        except FileNotFoundError:
            return True
        except OSError:
            return False


def parse_neighbours(text: str) -> dict[int, int]:
    """``"0 123;1 124;"`` (what the ranks of one machine appended) as ``{0: 123, 1: 124}``."""
    pairs = (entry.split() for entry in text.split(";") if entry.strip())
    return {int(rank): int(pid) for rank, pid in pairs}
