"""What float8 training can gain on a GPU, from the shapes alone: a roofline of the linear layers it converts.

``bench_mfu.py --float8`` measures float8's tokens/s against bf16's. A ratio says how far a run got, not how far it
could have got: a model whose converted layers are a small share of the step, or small enough that the casts around
each multiply cost what the float8 multiply saves, cannot reach issue 29's goal (1.2x) however good the kernels.
This module says what to expect, so that the two can be told apart (``benchmarks/RESULTS.md``, 2026-11-28).

The model (torchao's ``float8_roofline`` reasons the same way; its constants for an H100 are the source of the two
efficiencies below), for each layer that ``modelpar.float8.float8_layers`` converts, ``M`` tokens a step,
``K`` inputs and ``N`` outputs:

* **Multiplies**: the forward's (``M x K`` by ``K x N``), the input gradient's and the weight gradient's, each
  taking the longer of its arithmetic (``2MKN`` at :data:`GEMM_EFFICIENCY` of the dense peak) and its memory
  traffic (operands read, the bf16 result written, at :data:`BANDWIDTH_EFFICIENCY` of the bandwidth).
* **Casts** (float8 only): the bf16 passes over the input, the weight and the output gradient, and the float8
  copies written, each operand in the layouts its multiplies need (:data:`CAST_PASSES`). At best, the first pass
  over an activation (the input, the output gradient) rides in the kernel that produced it, as inductor fuses
  it; the weight's passes do not. Scales are a few bytes and are left out.

Under full activation checkpointing (``recompute``) each layer's forward multiply and its casts count twice;
selective checkpointing (modelpar's policy) saves the multiplies' outputs, so they run once.

Everything else in the step (attention, norms, the output layer, the optimizer) is taken as measured in bf16:
:meth:`Roofline.step_speedup` replaces the converted layers' bf16 time by their float8 time in the measured bf16
step. The casts are a best case; the step is an estimate, not a bound: a bf16 multiply slower than its roofline
leaves more to gain, a float8 one slower than its roofline less. The layers kept in high precision (the output
layer) have their bf16 multiplies counted apart (``Roofline.kept_s``), so that ``bench_mfu.py --profile`` can set
all of a run's measured multiplies against their roofline.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from _mfu_variants import for_device
from torch import nn

from modelpar.float8 import Float8Training, float8_layers
from modelpar.models import Llama, LlamaConfig

__all__ = [
    "BANDWIDTH_EFFICIENCY",
    "CAST_PASSES",
    "GEMM_EFFICIENCY",
    "SPECS",
    "RECOMPUTE_PASSES",
    "GpuSpecs",
    "Roofline",
    "layer_shapes",
    "roofline",
    "specs_for",
]


@dataclass(frozen=True)
class GpuSpecs:
    """A GPU's dense peaks (TFLOP/s, no sparsity) in bf16 and float8, and its memory bandwidth (TB/s)."""

    bf16_tflops: float
    float8_tflops: float
    bandwidth_tb_s: float


#: By a fragment of ``torch.cuda.get_device_name()``, the longest matching first (``_mfu_variants.for_device``):
#: NVIDIA's data sheets for the SXM parts. GPUs without float8 multiplies (A100) have none: float8 does not run there.
SPECS = {
    "H100": GpuSpecs(989.4, 1978.9, 3.35),
    "H800": GpuSpecs(989.4, 1978.9, 3.35),
    "H200": GpuSpecs(989.4, 1978.9, 4.8),
    "GH200": GpuSpecs(989.4, 1978.9, 4.0),  # its HBM3 part; the HBM3e one has 4.9 TB/s
    "B200": GpuSpecs(2250.0, 4500.0, 8.0),
}

#: The share of the dense peak a large multiply reaches, and of the bandwidth a large elementwise kernel reaches:
#: torchao's observations on an H100 (``torchao/testing/training/roofline_utils.py``, 0.18), taken for every GPU.
GEMM_EFFICIENCY, BANDWIDTH_EFFICIENCY = 0.78, 0.92

#: For each recipe and operand role: (bf16 passes over the operand, float8 copies written). Tensorwise: one pass
#: for the tensor's absolute maximum, one to cast, and a copy in each of the two layouts its multiplies read.
#: Rowwise: the two layouts are scaled along different dimensions, so each is a pass of its own. The weight-gradient
#: multiply of ``rowwise_with_gw_hp`` stays in bf16: its input and output gradient need one float8 layout only.
CAST_PASSES: dict[str, dict[str, tuple[int, int]]] = {
    "tensorwise": {"input": (2, 2), "weight": (2, 2), "grad_output": (2, 2)},
    "rowwise": {"input": (2, 2), "weight": (2, 2), "grad_output": (2, 2)},
    "rowwise_with_gw_hp": {"input": (1, 1), "weight": (2, 2), "grad_output": (1, 1)},
}

#: Under full activation checkpointing each layer's forward runs again in backward: its multiply, and the casts of
#: the input and the weight into the forward's layout, (bf16 passes, float8 copies) as in :data:`CAST_PASSES`.
#: Tensorwise finds the weight's absolute maximum again; a rowwise cast is one pass.
RECOMPUTE_PASSES: dict[str, dict[str, tuple[int, int]]] = {
    "tensorwise": {"input": (1, 1), "weight": (2, 1)},
    "rowwise": {"input": (1, 1), "weight": (1, 1)},
    "rowwise_with_gw_hp": {"input": (1, 1), "weight": (1, 1)},
}

_BF16, _FLOAT8 = 2, 1  # bytes per element


@dataclass(frozen=True)
class Roofline:
    """The converted layers' time in one step at the roofline, in seconds: their multiplies in bf16 and in float8,
    and float8's casts."""

    recipe: str
    layers: int
    bf16_s: float
    float8_s: float
    casts_s: float
    #: The multiplies of the layers kept in high precision (the output layer), the same in bf16 and float8 training.
    kept_s: float = 0.0

    @property
    def linears_speedup(self) -> float:
        """How much faster the converted layers run in float8, casts included."""
        return self.bf16_s / (self.float8_s + self.casts_s)

    def step_speedup(self, bf16_step_s: float) -> float:
        """The step's speed-up if the converted layers' bf16 time in a measured bf16 step became their float8 time."""
        return bf16_step_s / (bf16_step_s - self.bf16_s + self.float8_s + self.casts_s)


def specs_for(device_name: str) -> GpuSpecs | None:
    """The specs of the GPU so named, or ``None`` for one :data:`SPECS` does not know."""
    return for_device(SPECS, device_name)


def layer_shapes(cfg: LlamaConfig, recipe: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(in_features, out_features)`` of the linear layers of ``modelpar.models.Llama`` that the float8 plan
    converts, and of those it keeps in high precision (the output layer): modelpar's own choice
    (:func:`modelpar.float8.float8_layers`)."""
    with torch.device("meta"):
        model = Llama(cfg)
    chosen, kept = float8_layers(model, Float8Training(recipe))  # type: ignore[arg-type]
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    converted = [(linears[name].in_features, linears[name].out_features) for name in chosen]
    return converted, [(m.in_features, m.out_features) for name, m in linears.items() if name in kept]


def _multiply_s(m: int, k: int, n: int, specs: GpuSpecs, operand_bytes: int) -> float:
    """One multiply of ``m x k`` by ``k x n``: the longer of its arithmetic and its memory traffic (bf16 result)."""
    tflops = specs.float8_tflops if operand_bytes == _FLOAT8 else specs.bf16_tflops
    arithmetic = 2 * m * k * n / (tflops * 1e12 * GEMM_EFFICIENCY)
    moved = (m * k + k * n) * operand_bytes + m * n * _BF16
    traffic = moved / (specs.bandwidth_tb_s * 1e12 * BANDWIDTH_EFFICIENCY)
    return max(arithmetic, traffic)


def _cast_bytes(passes: dict[str, tuple[int, int]], elements: dict[str, int]) -> int:
    """Bytes the casts move: each operand's bf16 passes and float8 copies (an activation's first pass fused)."""
    moved = 0
    for role, (reads, copies) in passes.items():
        fused = 1 if role != "weight" else 0  # an activation's first pass rides in the kernel that made it
        moved += elements[role] * ((reads - fused) * _BF16 + copies * _FLOAT8)
    return moved


def roofline(
    shapes: Iterable[tuple[int, int]],
    tokens: int,
    recipe: str,
    specs: GpuSpecs,
    *,
    kept: Iterable[tuple[int, int]] = (),
    recompute: bool = False,
) -> Roofline:
    """The roofline of converted layers of these ``(in_features, out_features)`` with ``tokens`` tokens a step, and
    of the ``kept`` ones' bf16 multiplies; with ``recompute`` (full activation checkpointing), each converted
    layer's forward twice (:data:`RECOMPUTE_PASSES`; the output layer is outside the checkpointed blocks)."""
    kept_s = sum(
        _multiply_s(*mkn, specs, _BF16) for k, n in kept for mkn in ((tokens, k, n), (tokens, n, k), (k, tokens, n))
    )
    bf16_s = float8_s = casts_s = 0.0
    layers = 0
    bandwidth = specs.bandwidth_tb_s * 1e12 * BANDWIDTH_EFFICIENCY
    for k, n in shapes:
        layers += 1
        m = tokens
        forward, input_gradient, weight_gradient = (m, k, n), (m, n, k), (k, m, n)
        bf16_s += sum(_multiply_s(*mkn, specs, _BF16) for mkn in (forward, input_gradient, weight_gradient))
        float8_s += _multiply_s(*forward, specs, _FLOAT8) + _multiply_s(*input_gradient, specs, _FLOAT8)
        float8_s += _multiply_s(*weight_gradient, specs, _BF16 if recipe == "rowwise_with_gw_hp" else _FLOAT8)
        elements = {"input": m * k, "weight": k * n, "grad_output": m * n}
        casts_s += _cast_bytes(CAST_PASSES[recipe], elements) / bandwidth
        if recompute:
            bf16_s += _multiply_s(*forward, specs, _BF16)
            float8_s += _multiply_s(*forward, specs, _FLOAT8)
            casts_s += _cast_bytes(RECOMPUTE_PASSES[recipe], elements) / bandwidth
    return Roofline(recipe, layers, bf16_s, float8_s, casts_s, kept_s)
