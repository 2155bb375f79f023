"""A run folder of numbered checkpoints: save every N steps, keep the last k, resume from the newest complete one.

Layout: ``<run_dir>/step-<N>`` (``N`` zero-padded to 9 digits, so listing order is step order), each a
checkpoint in either format (a folder, or one file), written through the caller's saver, so atomic locally and
marker-committed at URLs (see :mod:`modelpar.checkpoint._commit` and :mod:`modelpar.checkpoint._remote`).
``run_dir`` is a local path or an fsspec URL (``s3://bucket/run`` ...).

Which checkpoints count as complete, from names and cheap listings only (no checkpoint is opened):

* local: a non-empty file ``step-<N>``, or a folder ``step-<N>`` holding a non-empty DCP ``.metadata``
  (written last); the hidden leftovers of interrupted saves or deletions (``.step-<N>.partial-<token>``,
  ``.step-<N>.old-<token>``) never count;
* at a URL: an object ``step-<N>``, or a prefix holding ``.modelpar-complete`` (or, written by another tool,
  DCP's ``.metadata`` and no ``.modelpar-writing``).

A preempted or killed job therefore restarts from the newest checkpoint that was fully written, never from
half of one. Old checkpoints are deleted on rank 0 in a background thread after the next save, so the
training never waits for a slow ``rm -r`` or thousands of object deletions.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from modelpar._rank_zero import rank_zero_warn
from modelpar.checkpoint._agree import run_agreed
from modelpar.checkpoint._checkpointer import Checkpointer
from modelpar.checkpoint._format import DCP_METADATA
from modelpar.checkpoint._remote import Location, RemotePath, prefix_state, to_location, withdraw

__all__ = ["RunCheckpoints", "checkpoint_name", "flag_device", "parse_step", "to_delete"]

_DIGITS = 9
_VISIBLE = re.compile(r"^step-(\d+)$")
_LEFTOVER = re.compile(r"^\.step-(\d+)\.(?:partial|old)-[0-9a-zA-Z]+$")
_SIGNALS = ("SIGTERM", "SIGUSR1")


def checkpoint_name(step: int) -> str:
    """``step-000000042``: zero-padded, so that a plain listing sorts by step."""
    return f"step-{step:0{_DIGITS}d}"


def parse_step(name: str) -> tuple[int, bool] | None:
    """``(step, is_leftover)`` for ``step-<N>`` (any padding) or a hidden leftover of one; ``None`` otherwise."""
    for pattern, leftover in ((_VISIBLE, False), (_LEFTOVER, True)):
        match = pattern.match(name)
        if match:
            return int(match.group(1)), leftover
    return None


@dataclass(frozen=True)
class Entry:
    """One entry of a run folder: its step, where it is, and ``"complete"``, ``"incomplete"`` or ``"leftover"``."""

    step: int
    location: Location
    state: str
    why: str = ""


def to_delete(entries: Sequence[Entry], just_saved: int, keep_last: int | None) -> list[Entry]:
    """What retention deletes after the save of ``just_saved``: pure, so the rule is tested on its own.

    Kept: the ``keep_last`` newest complete checkpoints, counting ``just_saved`` as one of them whatever it looks
    like now (an asynchronous save may still be writing it), and everything at or after ``just_saved`` (never
    the one just written, nor a save still in progress). Deleted: older complete checkpoints beyond those, and
    older incomplete ones and leftovers, which no save is writing any more (saves run one after another).
    """
    older = [e for e in entries if e.step < just_saved]
    stale = [e for e in older if e.state != "complete"]
    if keep_last is None:
        return stale
    complete = sorted((e for e in older if e.state == "complete"), key=lambda e: e.step, reverse=True)
    return stale + complete[max(keep_last - 1, 0) :]


def flag_device(backend: str) -> str:
    """The device type of the signal flag's all-reduce: ``"cpu"`` if the default group has gloo, else ``"cuda"``."""
    return "cpu" if "gloo" in backend or "nccl" not in backend else "cuda"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class RunCheckpoints:
    """Checkpoints of one run in ``run_dir``: periodic saves, retention, resume, and a final save on a signal.

    Collective, like the saver it drives: every rank calls :meth:`resume` and :meth:`maybe_save` with the same
    arguments. ``saver``: a Lightning ``Fabric``, one of modelpar's strategies (standalone), or a
    :class:`~modelpar.checkpoint.Checkpointer` (which writes the format ``full`` says; the others write their
    strategy's format). A loop that calls :meth:`resume` first restarts where the last complete save left off::

        run = RunCheckpoints("s3://bucket/run", every_n_steps=500, keep_last=3, save_on_signal=True)
        start = run.resume(fabric, state)
        for step in range(start + 1, max_steps + 1):
            train_step(step)
            run.maybe_save(fabric, step, state)    # after the optimizer step ``step``
        run.close()

    ``keep_last``: how many complete checkpoints to keep (``None``: all). ``storage_options``: fsspec options
    for a URL ``run_dir`` (endpoint, credentials), used to list and delete, and by a ``Checkpointer`` saver;
    ``Fabric.save`` takes none, so Fabric and the strategies read the file system's own configuration (for S3
    the ``AWS_*`` variables), which then serves here as well. ``save_on_signal``: on SIGTERM or
    SIGUSR1 (a preemption notice, SLURM's ``--signal``), the next :meth:`maybe_save` saves a checkpoint of the
    current step on every rank and raises ``SystemExit``; this costs one all-reduce of one number per call.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | RemotePath,
        *,
        every_n_steps: int,
        keep_last: int | None = None,
        storage_options: Mapping[str, Any] | None = None,
        save_on_signal: bool = False,
        full: bool = False,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(
                f"`every_n_steps={every_n_steps!r}` must be a whole number of steps, at least 1 (1: save every step)."
            )
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(
                f"`keep_last={keep_last!r}` must be at least 1 (the checkpoint a restart resumes from), or None to"
                " keep every checkpoint."
            )
        self.run_dir = to_location(run_dir, storage_options)
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.save_on_signal = save_on_signal
        self.full = full
        self._signalled: int | None = None
        self._previous: dict[int, Any] = {}
        self._deleting: threading.Thread | None = None
        self._complete: set[int] = set()  # rank 0: steps found complete, not checked again
        if save_on_signal:
            self._install_handlers()

    # -- finding ---------------------------------------------------------------------------------------
    def location(self, step: int) -> Location:
        """Where the checkpoint of ``step`` goes."""
        return self.run_dir / checkpoint_name(step)

    def latest(self) -> tuple[int, Location] | None:
        """``(step, location)`` of the newest complete checkpoint, or ``None``; the same answer on every rank.

        Rank 0 looks (one listing, plus one per remote folder it checks) and tells the others (collective), so
        ranks never resume from different steps, even if a save lands while they look. Newer checkpoints that
        are incomplete (an interrupted save) are skipped with a warning on rank 0.
        """

        def look() -> int | None:
            for entry in sorted(self._listing(), key=lambda e: (e.step, e.state != "leftover"), reverse=True):
                entry = self._checked(entry)  # newest first, only until the first complete one
                if entry.state == "complete":
                    return entry.step
                why = entry.why or (
                    "an interrupted save or deletion left it (a hidden `.partial-` or `.old-` name); it is not a"
                    " checkpoint"
                )
                rank_zero_warn(
                    f"Skipping {str(entry.location)!r}: {why}. Resuming from an earlier checkpoint, if any; the next"
                    " save deletes it."
                )
            return None

        step = run_agreed(f"Looking for checkpoints in {str(self.run_dir)!r}", look, here=_rank() == 0)[0]
        return None if step is None else (step, self.location(step))

    def _listing(self) -> list[Entry]:
        """Rank 0: the run folder's checkpoints (state ``"file"`` or ``"folder"``, unchecked) and leftovers."""
        if isinstance(self.run_dir, RemotePath):
            self.run_dir.fs.invalidate_cache(self.run_dir.fs_path)
            try:
                listing = self.run_dir.fs.ls(self.run_dir.fs_path, detail=True)  # one request, with the types
            except FileNotFoundError:
                return []
            named = [(str(i["name"]).rstrip("/").rsplit("/", 1)[-1], i.get("type") == "directory") for i in listing]
        elif self.run_dir.is_dir():
            named = [(path.name, path.is_dir()) for path in self.run_dir.iterdir()]
        else:
            return []
        out = []
        for name, folder in named:
            parsed = parse_step(name)
            if parsed is not None:
                state = "leftover" if parsed[1] else ("folder" if folder else "file")
                out.append(Entry(parsed[0], self.run_dir / name, state))
        return out

    def _checked(self, entry: Entry) -> Entry:
        """``entry`` of :meth:`_listing` as ``"complete"`` or ``"incomplete"`` (with why); leftovers stay."""
        if entry.state == "leftover" or entry.step in self._complete:
            return entry if entry.state == "leftover" else Entry(entry.step, entry.location, "complete")
        location = entry.location
        why = ""
        if isinstance(location, RemotePath):
            if entry.state == "folder":
                state = prefix_state(location)
                if state == "partial":
                    why = "a save to it was interrupted (it has the writing marker but no commit marker)"
                elif state == "none":
                    why = f"it holds neither a commit marker nor {DCP_METADATA!r}"
        elif entry.state == "file":
            why = "" if location.stat().st_size > 0 else "the file is empty"
        else:
            meta = location / DCP_METADATA
            if not (meta.is_file() and meta.stat().st_size > 0):
                why = f"the folder has no (or an empty) {DCP_METADATA!r}, so its save did not finish"
        if why:
            return Entry(entry.step, location, "incomplete", why)
        self._complete.add(entry.step)  # stays so until retention deletes it: not listed, nor checked, again
        return Entry(entry.step, location, "complete")

    # -- resuming and saving ---------------------------------------------------------------------------
    def resume(self, saver: Any, state: dict[str, Any]) -> int:
        """Load the newest complete checkpoint into ``state`` (in place); its step, or 0 if there is none."""
        found = self.latest()
        if found is None:
            return 0
        step, location = found
        _load(saver, location, state)
        return step

    def maybe_save(self, saver: Any, step: int, state: Mapping[str, Any]) -> bool:
        """After the optimizer step ``step``: save if it is a multiple of ``every_n_steps``; whether it saved.

        With ``save_on_signal``, once any rank has received SIGTERM or SIGUSR1, every rank saves this step and
        raises ``SystemExit`` (after :meth:`close`).
        """
        stop = self._agree_on_signal() if self.save_on_signal else None
        due = step > 0 and step % self.every_n_steps == 0
        if due or stop is not None:
            self._join_deletions()
            self._complete.discard(step)  # saved again: incomplete until this save commits
            _save(saver, self.location(step), state, full=self.full)
            if _rank() == 0 and stop is None:  # on a signal, exit in time: the next run deletes them
                self._start_deletions(step)
        if stop is not None:
            self.close()
            name = signal.Signals(stop).name
            raise SystemExit(
                f"Received {name}: saved the checkpoint of step {step} to {str(self.location(step))!r} and stopped."
                " Restart the job to resume from it."
            )
        return due

    def close(self) -> None:
        """Wait for deletions in progress (rank 0) and give the signal handlers back."""
        self._join_deletions()
        for signum, handler in self._previous.items():
            with contextlib.suppress(ValueError):  # not the main thread: the interpreter keeps ours, harmless
                signal.signal(signum, handler)
        self._previous.clear()

    # -- retention -------------------------------------------------------------------------------------
    def _start_deletions(self, just_saved: int) -> None:
        def run() -> None:
            try:
                entries = [self._checked(entry) for entry in self._listing()]
                for entry in to_delete(entries, just_saved, self.keep_last):
                    self._complete.discard(entry.step)
                    _delete(entry.location)
            except Exception as err:  # a deletion left for the next pass must not stop the training
                rank_zero_warn(f"Deleting old checkpoints in {str(self.run_dir)!r} failed ({err}); retrying later.")

        self._deleting = threading.Thread(target=run, name="modelpar-run-retention", daemon=True)
        self._deleting.start()

    def _join_deletions(self) -> None:
        thread, self._deleting = self._deleting, None
        if thread is not None:
            thread.join()

    # -- signals ---------------------------------------------------------------------------------------
    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "`RunCheckpoints(save_on_signal=True)` must be created in the main thread: Python runs signal"
                " handlers there only. Create it in the main thread, or pass `save_on_signal=False`."
            )
        for name in _SIGNALS:
            signum = getattr(signal, name, None)
            if signum is not None:  # SIGUSR1 does not exist on Windows
                self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Only note the signal: saving inside a handler could interrupt a collective halfway."""
        self._signalled = signum
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)

    def _agree_on_signal(self) -> int | None:
        """The signal any rank received (one all-reduce of one number), or ``None``."""
        mine = self._signalled or 0
        if not dist.is_initialized():
            return mine or None
        kind = flag_device(str(dist.get_backend()))
        device = torch.device(kind, torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
        flag = torch.tensor([mine], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None


def _kind(saver: Any) -> str:
    """``"checkpointer"``, ``"fabric"`` (has ``save`` / ``load``) or ``"strategy"`` (``save_checkpoint`` ...)."""
    if isinstance(saver, Checkpointer):
        return "checkpointer"
    if callable(getattr(saver, "save", None)) and callable(getattr(saver, "load", None)):
        return "fabric"
    if callable(getattr(saver, "save_checkpoint", None)) and callable(getattr(saver, "load_checkpoint", None)):
        return "strategy"
    raise TypeError(
        f"Cannot save or load checkpoints with a {type(saver).__name__}: pass a Lightning `Fabric`, a modelpar"
        " strategy, or a `modelpar.checkpoint.Checkpointer`."
    )


def _save(saver: Any, location: Location, state: Mapping[str, Any], *, full: bool) -> None:
    kind = _kind(saver)
    if kind == "checkpointer":
        saver.save(location, state, full=full)
    elif kind == "fabric":
        saver.save(str(location), dict(state))
    else:
        saver.save_checkpoint(str(location), dict(state))


def _load(saver: Any, location: Location, state: dict[str, Any]) -> None:
    """Restore ``state`` in place (each saver assigns the plain entries, like ``"step"``, into it)."""
    kind = _kind(saver)
    if kind == "checkpointer":
        saver.load(location, state)
    elif kind == "fabric":
        saver.load(str(location), state)
    else:
        saver.load_checkpoint(str(location), state)


def _delete(location: Location) -> None:
    """Delete one checkpoint so that nothing left of it looks complete, even if the process dies meanwhile.

    Locally it is first renamed to a hidden leftover name (atomic), then removed; at a URL it is withdrawn
    (its commit marker goes first).
    """
    if isinstance(location, RemotePath):
        withdraw(location)
        return
    target: Path = location
    if not target.name.startswith("."):
        aside = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
        try:
            os.replace(target, aside)
        except FileNotFoundError:
            return
        target = aside
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)
