"""Shared pieces of the GPU suite: which device it runs on, how ranks share one GPU, and a case grid runner.

The suite runs on a machine with one GPU (``bash scripts/gpu-check.sh``):

* **one process with NCCL** on a 1x1 mesh, through Fabric and the Trainer (``accelerator="cuda", devices=1``):
  the real CUDA/NCCL paths (NCCL refuses two ranks on one GPU, "Duplicate GPU detected");
* **2 and 4 processes sharing the GPU over gloo**, through the standalone strategy with every rank's root
  device ``cuda:0``: the multi-rank logic (slicing, resharding, clipping, streaming) on CUDA tensors. What gloo
  runs on CUDA tensors is probed at run time with torch alone (:mod:`torch_probe`); a case that needs a call
  torch could not make here is skipped with that call and its error (:func:`needs`).

A skip cannot stand for a failure of modelpar. The shared-device cases skip only through :func:`needs`, from
the probe's record, before they run any modelpar code, and a case that needs a call the probe never recorded
fails; the one-process cases skip only for what the environment lacks (transformers, a GPU for a GPU-only
check). :func:`run_cases` reports as a failure any :class:`SkipCase` raised while another exception was being
handled, or from inside modelpar's code, and :func:`check` names a failed case's own error on its first line.

``MODELPAR_GPU_SUITE_DEVICE=cpu`` runs the very same cases on CPU processes (gloo everywhere): a self-check of
the suite's own code on a machine without a GPU. It is not part of CI (the CPU suite covers the behaviour);
without CUDA and without that variable every test here is skipped but the suite's own rules
(``test_gpu_suite_itself.py``, in the test process), which CI runs as the self-check does (``conftest.py``).

Each spawn runs a grid of named cases; every case catches its own failure, so one broken case reports its
traceback while the others still run, and the tests assert case by case.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from harness import run_distributed

#: Environment variable naming the device the suite runs on: "cuda" (default) or "cpu" (self-check).
DEVICE_VARIABLE = "MODELPAR_GPU_SUITE_DEVICE"


def device_type() -> str:
    value = os.environ.get(DEVICE_VARIABLE, "cuda")
    if value not in ("cuda", "cpu"):
        raise ValueError(f"{DEVICE_VARIABLE}={value!r}: use 'cuda' (the default) or 'cpu' (self-check).")
    return value


def device() -> torch.device:
    """The device every rank computes on: ``cuda:0`` (shared by all ranks) or the CPU in the self-check."""
    return torch.device("cuda", 0) if device_type() == "cuda" else torch.device("cpu")


def on_cuda() -> bool:
    return device_type() == "cuda"


def suite_available() -> tuple[bool, str]:
    if device_type() == "cpu":
        return True, ""
    if not torch.cuda.is_available():
        return False, f"needs CUDA (run `bash scripts/gpu-check.sh` on a GPU machine, or {DEVICE_VARIABLE}=cpu)"
    return True, ""


def run_cases(cases: dict[str, Callable[[], dict[str, Any]]], names: list[str] | None = None) -> dict[str, Any]:
    """Run each case (inside a rank); return ``{name: {"ok": True, ...figures}}``, ``{"ok": None, "skip": why}``
    or ``{"ok": False, "error": traceback}``.

    Every exception is a failure, a :class:`SkipCase` too when it is really a failure in disguise
    (:func:`_disguised_failure`): the one GPU run a task may get must not read as "skipped" where modelpar broke.
    """
    results: dict[str, Any] = {}
    rank = os.environ.get("RANK", "0")
    seconds: dict[str, float] = {}
    results[TIMES] = {"started": time.time(), "cases": seconds}
    for name in names or list(cases):
        # A crash (SIGSEGV in a kernel or in gloo) takes every result of the spawn with it: this line, and the
        # stack faulthandler prints (scripts/gpu-check.sh sets PYTHONFAULTHANDLER), say which case it was in.
        print(f"[gpu-suite] rank {rank} starts {name}", file=sys.stderr, flush=True)
        case_started = time.perf_counter()
        try:
            results[name] = {"ok": True, **(cases[name]() or {})}
        except SkipCase as skip:
            why_not = _disguised_failure(skip)
            if why_not is None:
                results[name] = {"ok": None, "skip": str(skip)}
            else:
                results[name] = {"ok": False, "error": f"{traceback.format_exc()}\n{why_not}", "cause": why_not}
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        finally:
            if on_cuda():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            seconds[name] = time.perf_counter() - case_started
    return results


#: The key :func:`run_cases` keeps its timing under, beside the cases' results: when the grid started (epoch
#: seconds, this machine's clock) and each case's seconds.
TIMES = "_time"


def spawn_cases(
    label: str, grid: Callable[..., dict[str, Any]], world: int, *args: Any, timeout: float, port: int | None = None
) -> Any:
    """``run_distributed(grid, world, *args)`` (on ``port``, default a free one), then one ``[gpu-suite] time
    <label>: {...}`` line: where the spawn's seconds went.

    A GPU run is measured in minutes a task may not have (``gpu-check.sh`` must stay under 5): the line says how
    long the processes took to start (imports, CUDA; the latest rank's) and each case (the slowest rank's), so
    the next cut goes where the time is. ``gpu_summary.py`` shows them.
    """
    started = time.time()
    results = run_distributed(grid, world, *args, timeout=timeout, port=port)
    print(f"[gpu-suite] time {label}: {spawn_times(results, started, time.time())}")
    return results


def spawn_times(results: list[dict[str, Any]], started: float, ended: float) -> dict[str, Any]:
    """``{"spawn": s, "start-up": s, "cases": {name: s}}`` from each rank's :data:`TIMES`, rounded to 0.1 s."""
    times = [r[TIMES] for r in results if TIMES in r]
    cases: dict[str, float] = {}
    for t in times:
        for name, s in t["cases"].items():
            cases[name] = max(cases.get(name, 0.0), s)
    start_up = max((t["started"] for t in times), default=ended) - started
    return {
        "spawn": round(ended - started, 1),
        "start-up": round(start_up, 1),
        "cases": {name: round(s, 1) for name, s in cases.items()},
    }


class SkipCase(Exception):
    """Raised inside a case that cannot run here for a reason outside modelpar: a call torch alone could not
    make on this device (:func:`needs`), or something the environment lacks. The test then skips."""


def needs(*collectives: str) -> None:
    """Skip the calling case if torch alone could not run one of ``collectives`` here (``torch_probe``'s names).

    Call it first in a shared-device case, before any modelpar code. The default process group is always
    needed. A name the probe never recorded is a failure: the probe did not run first, or broke, and a skip
    then would say something nobody saw.
    """
    import torch_probe

    informational = [name for name in collectives if name in torch_probe.INFORMATIONAL]
    if informational:
        raise ValueError(f"{informational} are recorded for information only; a case cannot skip on them")
    for name in ("init_process_group", *collectives):
        record = torch_probe.PROBED.get(name)
        if record is None:
            raise RuntimeError(
                f"this case needs {name!r}, but the probe recorded nothing for it (recorded:"
                f" {sorted(torch_probe.PROBED) or 'nothing'}). The probe case must run first in the spawn and"
                " finish; without its record the case fails rather than skip."
            )
        if record["error"] is not None:
            raise SkipCase(
                f"torch alone could not run {record['call']} over gloo with {os.environ.get('WORLD_SIZE')} ranks"
                f" on {device()} in torch {torch.__version__}: {record['error']} (probed before any modelpar"
                " code; the CPU suite covers this case's logic)"
            )


def _disguised_failure(skip: SkipCase) -> str | None:
    """Why ``skip`` is a failure after all, or ``None`` for a true skip.

    Raised while another exception was being handled (``except ...: raise SkipCase(...)``, ``from None``
    included), it would hide that exception; raised from inside modelpar (a plan function the strategy
    called), it would hide where modelpar's code stood. Either is reported as the failure it covers.
    """
    if skip.__context__ is not None:
        context = skip.__context__
        return (
            f"the suite reports this as a failure: SkipCase was raised while handling {type(context).__name__}:"
            f" {context}; an exception is a failure, never a reason to skip"
        )
    root = _modelpar_root()
    for frame, _ in traceback.walk_tb(skip.__traceback__):
        if root is not None and os.path.abspath(frame.f_code.co_filename).startswith(root):
            return (
                f"the suite reports this as a failure: SkipCase was raised inside modelpar's code"
                f" ({frame.f_code.co_filename}, {frame.f_code.co_name}); a skip must come before modelpar runs"
            )
    return None


def _modelpar_root() -> str | None:
    import importlib.util

    spec = importlib.util.find_spec("modelpar")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.abspath(next(iter(spec.submodule_search_locations))) + os.sep


def check(results_by_rank: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Assert that case ``name`` passed on every rank (pytest-skip it if it was skipped); return rank 0's figures.

    A failure's first line names the case's own error (the traceback's last line), so that pytest's short
    summary and ``gpu-check.sh``'s summary show the cause rather than "failed on 2 ranks".
    """
    import pytest

    missing = [r for r, res in enumerate(results_by_rank) if name not in res]
    if missing:
        raise AssertionError(f"case {name} has no result on rank(s) {missing}: the spawn's grid did not run it")
    failures = [(r, res[name]["error"]) for r, res in enumerate(results_by_rank) if res[name].get("ok") is False]
    skipped = [res[name]["skip"] for res in results_by_rank if res[name].get("ok") is None]
    if failures:
        first_rank, first = failures[0]
        cause = results_by_rank[first_rank][name].get("cause") or last_error_line(first)
        raise AssertionError(
            f"case {name} failed on {len(failures)} of {len(results_by_rank)} rank(s): {cause}"
            f" (rank {first_rank}; tracebacks below)\n" + "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in failures)
        )
    if skipped:
        pytest.skip(skipped[0])
    figures = {k: v for k, v in results_by_rank[0][name].items() if k != "ok"}
    print(f"[gpu-suite] {name}: {figures}")
    return figures


def last_error_line(tb: str) -> str:
    """The first line of the exception a formatted traceback ends in (``RuntimeError: No device(s) specified``).

    With chained exceptions that is the last one raised; without a traceback, the text's last line.
    """
    lines = tb.rstrip().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    for line in lines[starts[-1] + 1 :] if starts else []:
        if line.strip() and not line[0].isspace():
            return line.strip()[:300]
    return lines[-1].strip()[:300] if lines else "(no traceback)"


def reference(cfg: Any, *, built_on_cpu: bool = False) -> Any:
    """The one-process model from seed 0: built on the suite's device, or on the CPU (what offloaded models are
    materialized on, drawing from the CPU random stream) and moved there."""
    from modelpar.models import Llama

    torch.manual_seed(0)
    if built_on_cpu:
        return Llama(cfg).to(device())
    with torch.device(device()):
        return Llama(cfg)


def full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective), or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float().cpu() - b.detach().float().cpu()).abs().max().item()


def host_rss_bytes() -> int:
    """This process's resident host memory (Linux ``/proc``), for staging-copy measurements."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def pinned_host_bytes() -> int:
    """Bytes currently held by CUDA's pinned host allocator (0 without CUDA)."""
    if not on_cuda():
        return 0
    stats = torch.cuda.host_memory_stats()
    for key in ("allocated_bytes.current", "allocated_bytes.all.current", "reserved_bytes.current"):
        if key in stats:
            return int(stats[key])
    return int(sum(v for k, v in stats.items() if "bytes" in k and k.endswith("current")))
