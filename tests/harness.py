"""Run a function on N CPU processes with gloo: our own small harness for the distributed tests.

* one spawn runs a whole grid of cases (a spawn costs seconds; a case costs milliseconds);
* without CUDA the processes are forked from a server that has imported torch and Lightning once
  (:func:`_context`) instead of starting fresh interpreters; each gets the parent's environment as it is then;
* every process gets the launcher variables a real run would (``LOCAL_RANK``, ``NODE_RANK`` ...), optionally
  laid out as several simulated nodes on this machine;
* a rank that raises fails the test at once with every rank's traceback; the others are killed instead of
  being left to hang in a collective; a deadline bounds the whole run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar

#: Process-group timeout for tests: long enough for a slow CI machine, short enough to end a hang.
PG_TIMEOUT = timedelta(seconds=90)


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: each socket stays bound until all are, so no two can be the same port."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


T = TypeVar("T")


def side_by_side(calls: Sequence[Callable[[int], T]]) -> list[T | BaseException]:
    """Run every ``call(port)`` at once, each in a thread of its own with a port of its own (reserved together, so
    no two coincide); return what each returned, or the exception it raised.

    For spawns that do not depend on one another (the GPU suite's probes and case grids): on a GPU each spawn
    starts fresh interpreters (imports, CUDA), which one after another add up.
    """
    ports = free_ports(len(calls))
    with ThreadPoolExecutor(max_workers=max(len(calls), 1)) as pool:
        futures = [pool.submit(call, port) for call, port in zip(calls, ports, strict=True)]
        return [future.exception() or future.result() for future in futures]


def launcher_env(rank: int, world_size: int, nodes: int, port: int) -> dict[str, str]:
    per_node = world_size // nodes
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world_size),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % per_node),
        "NODE_RANK": str(rank // per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "OMP_NUM_THREADS": "1",
    }


#: What the fork server imports once: torch's distributed packages, Lightning Fabric (which imports torchmetrics and,
#: through it, transformers), both Trainer namespaces, modelpar with its Hugging Face and Trainer modules, and
#: torchao's float8 package, which transformers' quantizers import whenever torchao is installed (a model's
#: ``from_pretrained`` / ``from_config``: 5 s of CPU per rank). Also pytest (every rank imports its test module, which
#: imports pytest: 0.16 s of CPU) and s3fs (Lightning's ``ModelCheckpoint.setup`` asks ``module_available("s3fs")``,
#: which imports it: 0.9 s of CPU in every Trainer rank). A rank forked from the server starts its case at once
#: (a spawn of 4 ranks importing modelpar: 1.0 s to 0.14 s). modelpar reads its
#: environment when it runs, never at import, so the environment each rank gets (:func:`_process_env`) still applies.
#: A module that is not installed is skipped by the server.
_PRELOAD = [
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "lightning_fabric",
    "pytorch_lightning",
    "lightning.pytorch",
    "modelpar",
    "modelpar.fabric",
    "modelpar.hf",
    "modelpar.trainer",
    "transformers.quantizers.auto",
    "torchao.float8",
    "pytest",
    "s3fs",
]


def process_context() -> Any:
    """Where the processes come from: without CUDA, a fork server (one per pytest process) that has imported
    :data:`_PRELOAD`; with CUDA, fresh interpreters (``spawn``).

    A fresh interpreter spends 6 to 9 CPU seconds on those imports before it runs a case: on 2 cores, more than
    the cases of most spawns take. The server pays that once, and each process is forked from it (it has run
    nothing but the imports). A process that will use CUDA is not forked from one that may have initialised it.
    """
    import torch

    if torch.cuda.is_available():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _process_env(rank: int, world_size: int, nodes: int, port: int) -> dict[str, str]:
    """The parent's environment now (the fork server holds the one from its start) and the launcher variables."""
    return {**os.environ, **launcher_env(rank, world_size, nodes, port)}


def _worker(fn: Callable[..., Any], rank: int, env: dict[str, str], args: tuple[Any, ...], out: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # the fork server may hold the temporary directory of its start: read TMPDIR again
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(*args)
        # The queue pickles in a feeder thread, where a failure is only printed and the parent would wait for the
        # timeout: pickle here, so an unpicklable result is this rank's failure, reported at once.
        pickle.dumps(result)
        out.put((rank, True, result))
    except BaseException:
        out.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    nodes: int = 1,
    timeout: float = 240.0,
    port: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` spawned processes; return each rank's return value by rank.

    ``fn`` must be importable (module level) and return picklable values. ``port`` (default: a free one) is the
    store's ``MASTER_PORT``: spawns started at once pass ports reserved together, which cannot coincide.
    """
    if world_size % nodes:
        raise ValueError(f"world_size={world_size} is not a multiple of nodes={nodes}")
    ctx = process_context()
    out = ctx.Queue()
    port = port if port is not None else free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, _process_env(r, world_size, nodes, port), args, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(failures) < world_size:
            if failures:
                # Give the other ranks a moment to report their own errors (usually the same one), then stop.
                grace = time.monotonic() + 5
                while len(results) + len(failures) < world_size and time.monotonic() < grace:
                    _drain(out, results, failures, wait=0.2)
                break
            if time.monotonic() > deadline:
                failures[-1] = f"timed out after {timeout:.0f}s; ranks without a result: " + str(
                    sorted(set(range(world_size)) - set(results) - set(failures))
                )
                break
            _drain(out, results, failures, wait=0.5)
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
            if dead and not failures:
                _drain(out, results, failures, wait=1.0)
                for r in dead:
                    failures.setdefault(r, f"process exited with code {procs[r].exitcode} and no result")
    finally:
        for p in procs:
            if p.is_alive():
                p.join(timeout=10 if not failures else 0.1)
            if p.is_alive():
                p.kill()
    if failures:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
        raise AssertionError(f"{len(failures)} of {world_size} ranks failed:\n{report}")
    return [results[r] for r in range(world_size)]


def _drain(out: Any, results: dict[int, Any], failures: dict[int, str], wait: float) -> None:
    try:
        rank, ok, payload = out.get(timeout=wait)
    except queue.Empty:
        return
    (results if ok else failures)[rank] = payload


def run_and_kill_when(
    fn: Callable[..., Any], world_size: int, *args: Any, condition: Callable[[], bool], timeout: float = 120.0
) -> None:
    """Start ``fn`` on ``world_size`` processes and SIGKILL them all as soon as ``condition()`` holds.

    For crash tests: the condition watches the file system for a save in progress. Raises if the
    processes finish, or the deadline passes, before the condition is seen.
    """
    ctx = process_context()
    out = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, _process_env(r, world_size, 1, port), args, out), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while not condition():
            if all(not p.is_alive() for p in procs):
                errors = []
                while not out.empty():
                    errors.append(out.get())
                raise AssertionError(f"the processes ended before the condition was seen: {errors}")
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not seen within {timeout:.0f}s")
            time.sleep(0.002)
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(timeout=10)
