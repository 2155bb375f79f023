"""Peer liveness: end this process with a clear error when another process of the job dies or stops answering.

Why it exists. A collective blocks until every rank takes part. When a rank is killed (OOM killer, SIGKILL, a
lost node), the others block in their next collective until the process-group timeout (30 minutes) ends it, or,
on gloo where the kernel resets the dead process's sockets, fail at once with a bare "Connection reset by peer"
that does not say who died. What each launcher does about it on its own, and what this adds, is written up in
docs/checkpointing.md ("When a process dies").

How. Every rank runs one thread, started right after the default process group exists
(:func:`watch_peers`). Through its own client of the job's c10d store (``MASTER_ADDR:MASTER_PORT``: rank 0's
process under Lightning's launchers, torchrun's agent under torchrun) it bumps a heartbeat counter every
``peer_timeout / 6`` seconds (at most 5 s) and watches one peer's counter, the next rank's, so the store serves
a few small requests per rank and interval whatever the world size. A peer whose counter has not moved for
``peer_timeout`` seconds, or a store that has not answered for as long, is lost: the thread publishes that under
a key every rank polls, prints why to stderr and ends the process with :data:`PEER_LOST_EXIT_CODE`. It must end
it with ``os._exit``: the main thread is then usually blocked inside a C++ collective, where no Python
exception can reach it. A rank that stops normally (its main thread finished, the process group destroyed)
marks its counter as finished; once a rank has seen that, it stops judging, as the job is ending and silence
is then no death. The thread is a daemon with a ``stop()``, the shape test suites' leftover-thread checks accept
(Lightning's stops such threads after each test and fails on any other); the finished mark at exit comes from
``atexit`` and, in ``multiprocessing`` workers, which skip ``atexit``, from a ``multiprocessing`` finalizer.
Store requests run on short-lived daemon threads of their own: against a frozen store host a c10d client
blocks for good, and the watchdog must still judge.

When the main thread fails first (gloo's "Connection reset by peer"), an exception hook names the process that
died after the traceback, if one on this machine is gone or a finding was published.

The heartbeat needs the GIL: code holding it longer than ``peer_timeout`` (rare: torch ops release it) looks dead.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from modelpar._mesh.lost_peer import PEER_LOST_EXIT_CODE, hook_in, hook_out, lost_peer_message, record_for_torchrun
from modelpar._mesh.peers import RankProcess, StoreCall, parse_neighbours

__all__ = [
    "DEFAULT_PEER_TIMEOUT",
    "PEER_LOST_EXIT_CODE",
    "PeerTimeoutArg",
    "PeerWatchdog",
    "StaleClock",
    "heartbeat_interval",
    "lost_peer_message",
    "resolve_peer_timeout",
    "watch_peers",
]

PeerTimeoutArg = float | int | timedelta | None

#: Seconds without a heartbeat after which a peer counts as lost: far above a heartbeat's period (a few seconds),
#: far below the 30-minute collective timeout.
DEFAULT_PEER_TIMEOUT = 30.0

#: Added to a heartbeat counter by a rank that stops normally: a counter at or above it means "finished, not dead".
_FINISHED = 1 << 40


def resolve_peer_timeout(value: PeerTimeoutArg) -> float | None:
    """``peer_timeout`` as seconds (``None``: no watchdog); a clear ``TypeError``/``ValueError`` otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, timedelta)):
        raise TypeError(
            "`peer_timeout` must be a number of seconds, a `datetime.timedelta`, or None to turn the watchdog off,"
            f" but got {value!r}."
        )
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(
            f"`peer_timeout` must be a positive, finite number of seconds, but got {value!r}. Pass e.g."
            f" `peer_timeout={DEFAULT_PEER_TIMEOUT:g}` (the default), or None to turn the watchdog off."
        )
    return seconds


def heartbeat_interval(peer_timeout: float) -> float:
    """Seconds between heartbeats: six per ``peer_timeout``, at most 5 s (a few tiny requests), at least 50 ms."""
    return min(5.0, max(0.05, peer_timeout / 6))


class StaleClock:
    """When a counter last moved, by this process's monotonic clock: no clocks are compared across hosts.

    A counter never seen counts from the clock's creation, so a peer that died before its first heartbeat
    is found too.
    """

    def __init__(self, now: float) -> None:
        self._value: int | None = None
        self._since = now

    def observe(self, value: int, now: float) -> float:
        """Record ``value``; return for how many seconds it has not changed."""
        if value != self._value:
            self._value, self._since = value, now
        return now - self._since


#: Seconds between the thread's looks at whether the main thread or the process group has ended.
_GLANCE = 0.1

#: Seconds a last request may take (marking this rank finished at exit, publishing a verdict, naming a peer).
_LAST_WORDS = 2.0


class PeerWatchdog:
    """One rank's heartbeat thread over the job's store; see the module docstring. Start and stop are idempotent."""

    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        world_size: int,
        peer_timeout: float,
        prefix: str,
        group: Any = None,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.peer_timeout, self.interval = peer_timeout, heartbeat_interval(peer_timeout)
        self.group = group  # the default process group watched: when it is gone, the watchdog stops
        self.peer = (rank + 1) % world_size
        self._prefix, self._exit = prefix, exit
        self._stop = threading.Event()
        self._stopping = threading.Lock()  # held by whoever stops the watchdog, until the thread has ended
        self._thread: threading.Thread | None = None
        self._me = RankProcess.this()
        #: The ranks on this machine, as ``rank -> pid``: their death can be told from here at once, store or not.
        self.neighbours: dict[int, int] = {}

    def _key(self, *parts: object) -> str:
        return "/".join((self._prefix, *map(str, parts)))

    # -- life cycle ---------------------------------------------------------------------------------------
    def start(self) -> PeerWatchdog:
        if self._thread is None:
            self.store.set(self._key("who", self.rank), self._me.encode())
            self.store.append(self._key("machine", self._me.machine), f"{self.rank} {self._me.pid};")
            self.store.add(self._key("beat", self.rank), 1)
            self._thread = _WatchdogThread(self)
            self._thread.start()
            atexit.register(self.stop)
            # multiprocessing workers end with os._exit once their target returns, skipping atexit; they run these.
            multiprocessing.util.Finalize(None, self.stop, exitpriority=0)
            hook_in(self)
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        """Mark this rank finished (so peers do not take its silence for a death) and end the thread; quiet.

        Returns once the thread has ended, whichever thread calls it and however many call it at once (``atexit``,
        a finalizer, the thread itself on seeing the job end, a test suite's thread check): a caller that returned
        earlier could let the interpreter finalize while the last store request is still in flight.
        """
        own_thread = self._thread is threading.current_thread()
        if not self._stopping.acquire(blocking=not own_thread):
            return  # the thread itself, while another caller stops it and waits for it to end
        try:
            if self._stop.is_set():
                return
            self._stop.set()
            if self._thread is not None:
                # the store host may have finished first, or be frozen: then there is nobody to tell
                with contextlib.suppress(Exception):
                    StoreCall(lambda: self.store.add(self._key("beat", self.rank), _FINISHED)).wait(_LAST_WORDS)
                if not own_thread:
                    self._thread.join(timeout=self.interval + _LAST_WORDS)
                StoreCall.drain(_LAST_WORDS)  # none may return during finalization: that aborts the process
        finally:
            self._stopping.release()
        hook_out(self)

    # -- the thread ----------------------------------------------------------------------------------------
    def _exchange(self) -> tuple[str | None, int]:
        """One tick's requests: bump our counter, read a published verdict, read the watched peer's counter."""
        self.store.add(self._key("beat", self.rank), 1)
        self.neighbours = parse_neighbours(self.store.get(self._key("machine", self._me.machine)).decode())
        lost = self._key("lost")
        verdict = self.store.get(lost).decode() if self.store.check([lost]) else None
        return verdict, int(self.store.add(self._key("beat", self.peer), 0))

    def _run(self) -> None:
        last_answer = time.monotonic()
        peer_clock = StaleClock(last_answer)
        pending: StoreCall | None = StoreCall(self._exchange)
        judging = True  # until a rank is seen finishing normally: the job is ending then, silence is no death
        # The first heartbeats come sooner, so that the ranks of this machine are known within a second.
        period, last_beat = min(0.25, self.interval), last_answer
        while not self._stop.wait(min(_GLANCE, self.interval)):
            if self._job_over():
                self.stop()
                return
            if pending is not None and pending.done:  # read at once: a finding must spread within a heartbeat
                answered, pending = pending, None
                if answered.error is None and answered.result is not None:
                    verdict, beat = answered.result
                    last_answer = answered.finished
                    if verdict is not None:
                        reporter, what = verdict.split("\t", 1)
                        return self._fail(what, reported_by=int(reporter))
                    judging = judging and beat < _FINISHED
                    # judged on answers only: a store that does not answer must not make the peer look dead
                    if judging and peer_clock.observe(beat, answered.finished) >= self.peer_timeout:
                        what = self._describe(self.peer, f"has not sent a heartbeat for {self.peer_timeout:g} s")
                        return self._fail(what, publish=True, frozen=self.peer)
            if time.monotonic() - last_beat < period:
                continue
            last_beat, period = time.monotonic(), min(2 * period, self.interval)
            if judging and time.monotonic() - last_answer >= self.peer_timeout:
                return self._fail(self._store_lost(), frozen=0)  # rank 0 hosts it under Lightning's launchers
            if pending is None:  # one request at a time: a frozen store host leaves one thread waiting, not many
                pending = StoreCall(self._exchange)

    def _job_over(self) -> bool:
        """The main thread has finished (interpreter or ``multiprocessing`` exit), or the process group is gone."""
        if not threading.main_thread().is_alive():
            return True
        return self.group is not None and (not dist.is_initialized() or dist.group.WORLD is not self.group)

    def _describe(self, rank: int, silent: str) -> str:
        """'rank 3 (pid 123 on host node1) has exited' where this can be told, else '... <silent>'."""
        if rank in self._exited():
            return f"rank {rank} (pid {self.neighbours[rank]} on host {self._me.host}) has exited"
        peer = self._who(rank)
        if peer is None:
            return f"rank {rank} {silent} (it may have died before it could say where it runs)"
        return f"rank {rank} (pid {peer.pid} on host {peer.host}) {silent}: it died, hangs, or its host is unreachable"

    def _end_frozen(self, rank: int) -> None:
        """SIGKILL a silent rank that still runs on this machine (frozen, or hung holding the GIL): under Lightning's
        launchers nobody else would, and it may hold a GPU's memory. torchrun's agent does it itself (after 30 s),
        and its summary should show this rank's message, not a SIGKILL, as the first failure."""
        pid = self.neighbours.get(rank)
        if pid is None or rank == self.rank or "TORCHELASTIC_RUN_ID" in os.environ:
            return
        if not RankProcess("", pid, self._me.machine).gone():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                print(f"modelpar: rank {self.rank} killed rank {rank} (SIGKILL to pid {pid}).", file=sys.stderr)

    def _exited(self) -> list[int]:
        """The other ranks on this machine whose process has ended (known without the store)."""
        mine = self._me.machine
        return [r for r, pid in sorted(self.neighbours.items()) if r != self.rank and RankProcess("", pid, mine).gone()]

    def _who(self, rank: int) -> RankProcess | None:
        key = self._key("who", rank)
        try:
            text = StoreCall(lambda: self.store.get(key).decode() if self.store.check([key]) else "").wait(_LAST_WORDS)
        except Exception:  # only for the message
            return None
        return RankProcess.decode(text)

    def _store_lost(self) -> str:
        address = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        exited = self._exited()
        seen = f" ({self._describe(exited[0], '')})" if exited else ""
        return (
            f"the job's c10d store at {address} has not answered for {self.peer_timeout:g} s: the process hosting"
            f" it died (rank 0 under Lightning's launchers, the first node's agent under torchrun){seen} or is"
            " unreachable"
        )

    def _fail(
        self, what: str, *, reported_by: int | None = None, publish: bool = False, frozen: int | None = None
    ) -> None:
        """Publish the verdict for the other ranks, print it, and end the process (the main thread may be stuck)."""
        if self._stop.is_set():
            return  # stopped meanwhile: a normal end, not a death
        message = lost_peer_message(rank=self.rank, what=what, peer_timeout=self.peer_timeout, reported_by=reported_by)
        print(message, file=sys.stderr, flush=True)
        record_for_torchrun(message)
        if publish:  # else the others find out by their own clocks
            with contextlib.suppress(Exception):
                StoreCall(lambda: self.store.set(self._key("lost"), f"{self.rank}\t{what}")).wait(_LAST_WORDS)
                # This process may host the store (rank 0 under Lightning's launchers): stay until every rank has
                # had a heartbeat to read the finding, rather than leave them to find the store gone a timeout later.
                time.sleep(self.interval + _LAST_WORDS)
        if frozen is not None:
            self._end_frozen(frozen)
        self._exit(PEER_LOST_EXIT_CODE)

    # -- when the main thread fails first ------------------------------------------------------------------
    def diagnose(self) -> str | None:
        """A quick look (a few seconds at most): a published verdict, or a process on this machine that exited."""
        lost = self._key("lost")
        with contextlib.suppress(Exception):  # the store host may be the one that died; look at the processes
            verdict = StoreCall(lambda: self.store.get(lost).decode() if self.store.check([lost]) else "")
            reporter, _, what = verdict.wait(_LAST_WORDS).partition("\t")
            if what:
                return f"rank {reporter} found that {what}"
        exited = self._exited()
        if len(exited) > 1:  # the others may have failed because of the first; only their logs tell the order
            shown = ", ".join(f"{r} (pid {self.neighbours[r]})" for r in exited)
            return (
                f"ranks {shown} on host {self._me.host} have exited (the first to exit, the one whose log shows no"
                " error of its own, caused the others' errors)"
            )
        return self._describe(exited[0], "") if exited else None


class _WatchdogThread(threading.Thread):
    """The watchdog's thread: a daemon that ``stop()`` ends, marking this rank finished first.

    A daemon, so that it never keeps a process alive, and so that a test suite's leftover-thread check, which
    stops daemon threads through their ``stop()`` and fails on any other (Lightning's does, after every test),
    accepts a strategy's run that leaves it behind.
    """

    def __init__(self, watchdog: PeerWatchdog) -> None:
        super().__init__(target=watchdog._run, name="modelpar-peer-watchdog", daemon=True)
        self._watchdog = watchdog

    def stop(self) -> None:
        self._watchdog.stop()


_active: PeerWatchdog | None = None
_generation = 0  # process groups watched so far in this process: keeps keys apart when a job makes a new group


def watch_peers(peer_timeout: float | None, store_timeout: timedelta | None = None) -> PeerWatchdog | None:
    """Start this rank's watchdog over the default process group, once per group; ``None`` when there is nothing
    to watch (one process, ``peer_timeout=None``, or no ``MASTER_ADDR``/``MASTER_PORT`` to reach the store at)."""
    global _active, _generation
    if _active is not None and _active.running and _active.group is dist.group.WORLD:
        return _active
    address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if peer_timeout is None or not dist.is_initialized() or dist.get_world_size() < 2 or not address or not port:
        return None
    try:
        store = dist.TCPStore(
            address,
            int(port),
            is_master=False,
            timeout=store_timeout or timedelta(seconds=max(1.0, heartbeat_interval(peer_timeout))),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError) as error:  # the group was made elsewhere (file://, tcp://...): a warning, no stop
        warnings.warn(
            f"modelpar's peer watchdog is off on rank {dist.get_rank()}: the c10d store at {address}:{port} (from"
            f" MASTER_ADDR/MASTER_PORT) cannot be reached ({error}). A rank that dies may then leave the others"
            " waiting for the collective timeout. Pass `peer_timeout=None` to the strategy to silence this.",
            stacklevel=2,
        )
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # torchrun's store outlives a restart
    _generation += 1
    _active = PeerWatchdog(
        store,
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        peer_timeout=peer_timeout,
        prefix=f"modelpar/watchdog/{attempt}/{_generation}",
        group=dist.group.WORLD,
    ).start()
    return _active
