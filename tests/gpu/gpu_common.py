"""Shared pieces of the GPU suite: which device it runs on, how ranks share one GPU, and a case grid runner.

The suite runs on a machine with one GPU (``bash scripts/gpu-check.sh``):

* **one process with NCCL** on a 1x1 mesh, through Fabric and the Trainer (``accelerator="cuda", devices=1``):
  the real CUDA/NCCL paths (NCCL refuses two ranks on one GPU, "Duplicate GPU detected");
* **2 and 4 processes sharing the GPU over gloo**, through the standalone strategy with every rank's root
  device ``cuda:0``: the multi-rank logic (slicing, resharding, clipping, streaming) on CUDA tensors. Which
  collectives gloo runs on CUDA tensors is probed at run time (:func:`case_gloo_cuda_collectives`); a case that
  needs one gloo cannot run is skipped with that reason instead of failing.

``MODELPAR_GPU_SUITE_DEVICE=cpu`` runs the very same cases on CPU processes (gloo everywhere): a self-check of
the suite's own code on a machine without a GPU. It is not part of CI (the CPU suite covers the behaviour);
without CUDA and without that variable every test here is skipped.

Each spawn runs a grid of named cases; every case catches its own failure, so one broken case reports its
traceback while the others still run, and the tests assert case by case.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

import torch

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
    """Run each case (inside a rank); return ``{name: {"ok": True, ...figures}}`` or ``{"ok": False, "error": tb}``."""
    results: dict[str, Any] = {}
    for name in names or list(cases):
        try:
            results[name] = {"ok": True, **(cases[name]() or {})}
        except SkipCase as skip:
            results[name] = {"ok": None, "skip": str(skip)}
        except BaseException:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        finally:
            if on_cuda():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    return results


class SkipCase(Exception):
    """Raised inside a case that cannot run here (a collective gloo lacks on CUDA tensors): the test skips."""


def check(results_by_rank: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """Assert that case ``name`` passed on every rank (pytest-skip it if it was skipped); return rank 0's figures."""
    import pytest

    failures = [
        f"--- rank {r} ---\n{res[name]['error']}" for r, res in enumerate(results_by_rank) if not _ok(res, name)
    ]
    skipped = [res[name]["skip"] for res in results_by_rank if res[name].get("ok") is None]
    if failures:
        raise AssertionError(f"case {name} failed on {len(failures)} rank(s):\n" + "\n".join(failures))
    if skipped:
        pytest.skip(skipped[0])
    figures = {k: v for k, v in results_by_rank[0][name].items() if k != "ok"}
    print(f"[gpu-suite] {name}: {figures}")
    return figures


def _ok(result: dict[str, Any], name: str) -> bool:
    return result[name].get("ok") is not False


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
