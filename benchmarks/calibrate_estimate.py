"""The activation model of ``estimate_memory`` against a CPU step: the calibration tables of ``docs/memory.md``.

    .venv/bin/python benchmarks/calibrate_estimate.py             # eager layers
    .venv/bin/python benchmarks/calibrate_estimate.py --compiled  # compiled layers (inductor: about an hour on 2 cores)

For each setting (model, sequence length, activation checkpointing, activation dtype; micro-batch 2; the models
include mixtures of experts: modelpar's MoE Llama, Qwen3-MoE, Mixtral) it builds
the model, runs forward and the loss under the CPU profiler's memory events, and prints the bytes live when
backward starts (measured) beside ``estimate_memory(...).stored_activations`` (estimated). The measurement is
``tests/memory_probe.py``, which the unit tests assert within 10% on the same grid. Bytes, not time: the
machine's load does not change them.

``--compiled``: every decoder layer checkpointed, then compiled (``ParallelPlan(compile=True)``'s order), the
estimate for a plan with ``compile=True``; measured under inductor (CPU, C++ code generation) and under
``aot_eager_decomp_partition`` (inductor's decompositions and partitioner, no code generation: what
``tests/unit/test_estimate_compiled.py`` runs, in seconds), which must agree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from memory_probe import CALIBRATION_MODELS, estimate_single_process, measure_single_process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compiled", action="store_true", help="compiled decoder layers (inductor; slow)")
    parser.add_argument("--models", default=",".join(CALIBRATION_MODELS), help="comma-separated (default: all)")
    args = parser.parse_args()
    compiled = args.compiled
    if compiled:
        print("| model | seq | AC | dtype | estimated (KiB) | inductor (KiB) | error | partitioner only (KiB) |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    else:
        print("| model | seq | AC | dtype | estimated (KiB) | measured (KiB) | error |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in args.models.split(","):
        for dtype in (torch.float32, torch.bfloat16):
            for seq_len in (128,) if compiled else (128, 256):
                for ac in ("none", "full", "selective"):
                    kwargs = {"seq_len": seq_len, "checkpointing": ac, "dtype": dtype}
                    backend = "inductor" if compiled else None
                    measured = measure_single_process(kind, **kwargs, compile_backend=backend)
                    estimated = estimate_single_process(kind, **kwargs, compile=compiled)
                    error = 100 * (estimated - measured) / measured
                    name = str(dtype).removeprefix("torch.")
                    row = f"| {kind} | {seq_len} | {ac} | {name} | {estimated / 1024:.1f} | {measured / 1024:.1f} |"
                    row += f" {error:+.1f}% |"
                    if compiled:
                        cheap = measure_single_process(kind, **kwargs, compile_backend="aot_eager_decomp_partition")
                        row += f" {cheap / 1024:.1f} |"
                    print(row, flush=True)


if __name__ == "__main__":
    main()
