"""The activation model of ``estimate_memory`` against a CPU step: a calibration table for ``docs/memory.md``.

    .venv/bin/python benchmarks/calibrate_estimate.py

For each setting (model, sequence length, activation checkpointing, activation dtype; micro-batch 2; the models
include mixtures of experts: modelpar's MoE Llama, Qwen3-MoE, Mixtral) it builds
the model, runs forward and the loss under the CPU profiler's memory events, and prints the bytes live when
backward starts (measured) beside ``estimate_memory(...).stored_activations`` (estimated). The measurement is
``tests/memory_probe.py``, which the unit tests assert within 10% on the same grid. Bytes, not time: the
machine's load does not change them.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from memory_probe import CALIBRATION_MODELS, estimate_single_process, measure_single_process


def main() -> None:
    print("| model | seq | AC | dtype | estimated (KiB) | measured (KiB) | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for kind in CALIBRATION_MODELS:
        for dtype in (torch.float32, torch.bfloat16):
            for seq_len in (128, 256):
                for ac in ("none", "full", "selective"):
                    kwargs = {"seq_len": seq_len, "checkpointing": ac, "dtype": dtype}
                    measured = measure_single_process(kind, **kwargs)
                    estimated = estimate_single_process(kind, **kwargs)
                    error = 100 * (estimated - measured) / measured
                    name = str(dtype).removeprefix("torch.")
                    print(
                        f"| {kind} | {seq_len} | {ac} | {name} | {estimated / 1024:.1f} | {measured / 1024:.1f} |"
                        f" {error:+.1f}% |"
                    )


if __name__ == "__main__":
    main()
