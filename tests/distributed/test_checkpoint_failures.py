"""A failure on one rank is an error on every rank, within seconds; a path not shared by all nodes is an error.

Two gloo processes (one spawn, every case): a fault is injected on rank 0 only (a full disk while preparing,
writing the file or ``meta.pt``, DCP's shard writer, the commit's rename, an error type of our own), in sync
and async saves of both formats. Every rank must raise the same error type, well before the process-group
timeout (30 s here). Then four processes laid out as two simulated nodes, each node working in its own folder
under the same relative path: saving and loading raise the same "not shared" error on every rank, and every
node removes its own stale leftovers.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter

import modelpar.checkpoint._checkpointer as checkpointer_module
from harness import run_distributed
from modelpar.checkpoint import Checkpointer, load_state, save_state

PG_TIMEOUT = timedelta(seconds=30)
FAST = 10.0  # seconds: every rank must have raised within this, far below the process-group timeout


class QuotaExceeded(Exception):
    """An error type that is not a built-in: the other ranks get a RuntimeError naming it."""


def _raise(error: BaseException) -> Callable[..., Any]:
    def fail(*args: Any, **kwargs: Any) -> Any:
        raise error

    return fail


@contextmanager
def fault(kind: str, active: bool) -> Iterator[None]:
    """Make one step of a save fail in this process (where ``active``)."""
    targets: dict[str, tuple[Any, str, BaseException]] = {
        "prepare": (checkpointer_module, "remove_stale", PermissionError(errno.EACCES, "Permission denied")),
        "write": (torch, "save", OSError(errno.ENOSPC, "No space left on device")),
        "quota": (torch, "save", QuotaExceeded("disk quota exceeded for user")),
        "shards": (FileSystemWriter, "write_data", OSError(errno.EIO, "Input/output error")),
        "commit": (os, "replace", OSError(errno.EIO, "Input/output error")),
    }
    owner, name, error = targets[kind]
    original = getattr(owner, name)
    if active:
        setattr(owner, name, _raise(error))
    try:
        yield
    finally:
        setattr(owner, name, original)


CASES = [
    (kind, full, async_save)
    for async_save in (False, True)
    for full in (True, False)
    for kind in ("prepare", "write", "quota", "shards", "commit")
    if not (kind == "shards" and full)  # the full format has no shards
]


def failure_grid(root: Path) -> dict[str, Any]:
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    outcomes: dict[str, Any] = {}
    for kind, full, async_save in CASES:
        case = f"{kind}-{'full' if full else 'distributed'}-{'async' if async_save else 'sync'}"
        checkpointer = Checkpointer(async_save=async_save)
        start = time.monotonic()
        raised: BaseException | None = None
        try:
            with fault(kind, active=rank == 0):
                checkpointer.save(root / case / "ckpt", {"model": model, "step": 1}, full=full)
                checkpointer.wait()  # async: the background outcome reaches every rank here
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            raised = err
        elapsed = time.monotonic() - start
        checkpointer.close()
        outcomes[case] = (type(raised).__name__ if raised else None, str(raised), elapsed)
        dist.barrier()
    # After all that, the same checkpointers still save and load.
    for async_save in (False, True):
        for full in (True, False):
            checkpointer = Checkpointer(async_save=async_save)
            path = root / f"ok-{full}-{async_save}" / "ckpt"
            checkpointer.save(path, {"model": model, "step": 2}, full=full)
            state = {"model": nn.Linear(4, 4), "step": 0}
            checkpointer.load(path, state)
            checkpointer.close()
            assert state["step"] == 2
            torch.testing.assert_close(state["model"].state_dict(), model.state_dict(), atol=0, rtol=0)
    return outcomes


def test_a_save_failing_on_one_rank_raises_the_same_error_on_every_rank_within_seconds(tmp_path):
    start = time.monotonic()
    rank0, rank1 = run_distributed(failure_grid, 2, tmp_path, timeout=180)
    print(f"\nfailure grid: {len(CASES)} cases in {time.monotonic() - start:.1f}s (spawn included)")
    for kind, full, async_save in CASES:
        case = f"{kind}-{'full' if full else 'distributed'}-{'async' if async_save else 'sync'}"
        (type0, message0, elapsed0), (type1, message1, elapsed1) = rank0[case], rank1[case]
        print(f"  {case:28} rank 0: {type0} in {elapsed0:.2f}s, rank 1: {type1} in {elapsed1:.2f}s")
        assert type0 is not None and type1 is not None, (case, rank0[case], rank1[case])
        assert max(elapsed0, elapsed1) < FAST, (case, elapsed0, elapsed1)
        if kind == "quota":  # not a built-in type: the failing rank has it, the others a RuntimeError naming it
            assert type0 == "QuotaExceeded"
            assert type1 == "RuntimeError" and "rank 0" in message1 and "QuotaExceeded" in message1, message1
        elif kind == "shards":  # DCP shares the failure itself, as its CheckpointException
            assert type0 == type1 == "CheckpointException", (type0, type1)
        else:
            assert type0 == type1, (case, type0, type1)
            assert "rank 0" in message1 and message0.split("]")[-1].strip() in message1, (message0, message1)
        if kind == "prepare":
            assert type0 == "PermissionError"


def not_shared_grid(root: Path) -> dict[str, Any]:
    """Each simulated node works in its own folder: ``ckpt`` is a different place on each node."""
    node = int(os.environ["NODE_RANK"])
    local = root / f"node{node}"
    local.mkdir(exist_ok=True)
    (local / ".ckpt.partial-stale").mkdir(exist_ok=True)  # an interrupted save's leftover on every node
    os.chdir(local)
    dist.init_process_group("gloo", timeout=PG_TIMEOUT)
    rank = dist.get_rank()
    model = nn.Linear(4, 4)
    outcomes: dict[str, Any] = {}

    def attempt(case: str, action: Callable[[], Any]) -> None:
        start = time.monotonic()
        try:
            action()
            outcomes[case] = (None, "", time.monotonic() - start)
        except Exception as err:
            outcomes[case] = (type(err).__name__, str(err), time.monotonic() - start)
        dist.barrier()

    attempt("save-full", lambda: save_state(Path("ckpt"), {"model": model}, full=True))
    outcomes["stale removed"] = not (local / ".ckpt.partial-stale").exists()
    dist.barrier()
    attempt("save-distributed", lambda: save_state(Path("ckpt"), {"model": model}, full=False))
    if rank == 0:  # a checkpoint that only node 0 sees
        torch.save({"model": model.state_dict()}, local / "only-here.pt")
    dist.barrier()
    attempt("load", lambda: load_state(Path("only-here.pt"), {"model": nn.Linear(4, 4)}))
    attempt("load-missing-everywhere", lambda: load_state(Path("nowhere"), {"model": nn.Linear(4, 4)}))
    return outcomes


def test_a_path_not_shared_by_all_nodes_raises_the_same_error_on_every_rank(tmp_path):
    results = run_distributed(not_shared_grid, 4, tmp_path, nodes=2, timeout=180)
    for case in ("save-full", "save-distributed", "load"):
        for rank, outcomes in enumerate(results):
            kind, message, elapsed = outcomes[case]
            assert kind == "RuntimeError", (case, rank, kind, message)
            assert "not shared by all processes" in message, message
            assert ("'ckpt'" if case.startswith("save") else "'only-here.pt'") in message, message
            assert "rank(s) 0 (" in message and ", 1 (" in message and "rank(s) 2 (" in message, message
            assert elapsed < FAST, (case, rank, elapsed)
        assert len({outcomes[case][1] for outcomes in results}) == 1, f"{case}: the messages differ between ranks"
    for rank, outcomes in enumerate(results):
        assert outcomes["stale removed"], f"the leftover on rank {rank}'s node was not removed"
        assert outcomes["load-missing-everywhere"][0] == "CheckpointNotFoundError", outcomes["load-missing-everywhere"]


@pytest.mark.parametrize("full", [True, False], ids=["full", "distributed"])
def test_a_failing_save_in_one_process_raises_its_own_error(tmp_path, full, monkeypatch):
    monkeypatch.setattr(os, "replace", _raise(OSError(errno.EIO, "Input/output error")))
    with pytest.raises(OSError, match="Input/output error"):
        save_state(tmp_path / "ckpt", {"model": nn.Linear(2, 2)}, full=full)
