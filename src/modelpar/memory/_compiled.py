"""What a decoder layer keeps for backward when the plan compiles it (``ParallelPlan(compile=True)``).

``torch.compile`` traces forward and backward into one joint graph, and inductor's partitioner
(``min_cut_rematerialization_partition``) chooses what forward saves: a minimum cut that keeps the tensors
backward cannot cheaply rebuild (matmul and attention outputs, reductions such as a norm's ``rsqrt``) and
recomputes pointwise chains (casts, the normalization itself, SiLU, RoPE, the residual add) inside backward's
fused kernels. Eager PyTorch keeps every intermediate an op saves; a compiled layer keeps what follows (read off
the partitioned backward graph's inputs, ``TORCH_LOGS=aot_graphs``, on ``modelpar.models.Llama``, Hugging Face
Llama and Qwen3; notation of :mod:`modelpar.memory._activations`):

- without checkpointing: the layer input (``b s d a``); per RMSNorm its ``rsqrt`` (fp32 per token) and its output,
  the projections' input (``b s d a``; no fp32 copies, no normalized value); the attention output projection's
  output (``b s d a``, from which backward rebuilds the residual that the second norm saw); attention as in eager
  (q, k and v as the kernel sees them, its output, its log-sum-exp); of the SwiGLU the gate and up projections'
  outputs and their product (``3 b s f a``: the SiLU is recomputed). Per-head q / k norms (Qwen3) keep the q and k
  projections' outputs and an ``rsqrt`` per head and token;
- ``"selective"`` (the region tagged by :data:`~modelpar.plans._checkpointing.SAVED_OPS`): what eager keeps but
  the down projection's output, which backward never reads (eager's policy saves it because it is a matmul; the
  partitioner drops saved values nothing uses);
- ``"full"``: the layer input, as in eager.

A mixture-of-experts feed-forward breaks the graph (data-dependent routing): without checkpointing it is counted
as in eager (:mod:`modelpar.memory._moe`) and its layer's norms and attention as compiled, 5-8% above the
measured bytes; under checkpointing the break falls inside the checkpointed region, dynamo runs the layers
eagerly, and they are counted as eager. Only whole decoder layers count as compiled: a plan whose outermost FSDP
units are parts of a layer compiles those parts, and the layer is counted as eager.

Measured with ``tests/memory_probe.py`` (``measure_single_process(compile_backend=...)``): inductor on CPU and
the ``aot_eager_decomp_partition`` backend (inductor's decompositions and partitioner, no code generation) keep
the same bytes; ``benchmarks/calibrate_estimate.py --compiled`` prints the table of ``docs/memory.md``. On one
H200 (torch 2.11) the peaks of the compiled 1.07B Llama leave the layers within 2% of these terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from modelpar.plans._plan import ParallelPlan
from modelpar.plans._units import outermost

__all__ = ["LayerTerms", "compiled_layers", "compiled_terms", "float8_saving"]

_FP32 = 4


@dataclass(frozen=True)
class LayerTerms:
    """A dense layer's bytes by the parts :func:`~modelpar._activations.activation_bytes` sums, eager or compiled."""

    norms: int  # the norms and the residual stream (compiled: the layer input, the attention projection's output)
    mlp: int  # without checkpointing
    mlp_selective: int  # under "selective"


def compiled_terms(
    *, rows: int, stream_rows: int, d: int, f: int, h: int, g: int, e: int, a: int, qk_norm: bool
) -> LayerTerms:
    """A compiled layer's terms (see the module docstring); sizes are local (after tensor parallelism).

    ``rows``: tokens a projection sees (``b s``); ``stream_rows``: tokens of the residual stream (``b s / tp``
    under sequence parallelism, where the norms run on the local tokens and their outputs are all-gathered).
    """
    norms = stream_rows * d * a  # the layer input
    norms += 2 * stream_rows * _FP32 + 2 * rows * d * a  # per norm: rsqrt per token, output (projections' input)
    norms += stream_rows * d * a  # attention output projection's output: backward rebuilds the residual from it
    if qk_norm:
        norms += rows * (h + g) * (e * a + _FP32)  # q and k projections' outputs, rsqrt per head and token
    return LayerTerms(norms=norms, mlp=3 * rows * f * a, mlp_selective=2 * rows * f * a)


def float8_saving(*, rows: int, d: int, f: int, a: int, moe: bool) -> int:
    """What a compiled, not checkpointed decoder layer whose linear layers train in float8 keeps less than the same
    layer compiled in high precision (:mod:`modelpar.memory._float8`; ``f`` on one tensor-parallel rank).

    The partitioner recomputes a float8 layer's input and casts it again in backward, where it keeps it otherwise:
    the attention norm's output (``rows d a``) and, in a dense layer (``moe=False``), the feed-forward norm's output
    and the SwiGLU product (``rows f a``). Measured under emulation with inductor on CPU; the partitioner alone
    (``aot_eager_decomp_partition``) keeps the attention norm's output as float8 instead in fp32 (``rows d`` bytes).
    """
    return rows * d * a + (0 if moe else rows * d * a + rows * f * a)


def compiled_layers(model: nn.Module, units: list[str], plan: ParallelPlan, *, moe: bool) -> tuple[frozenset[int], str]:
    """(indices of the decoder layers the plan compiles whole, why the others count as eager: ``""`` if none do).

    The plan compiles its outermost FSDP units; a decoder layer (``layers.3``, ``model.layers.3``: an entry of a
    ``ModuleList`` outside any other layer) is compiled when such a unit is the layer or holds it. In a model with
    mixtures of experts (``moe``) under activation checkpointing no layer is: the routing breaks the graph inside
    the checkpointed region, and dynamo then runs the layers eagerly (measured: the eager bytes).
    """
    if not plan.compile:
        return frozenset(), ""
    top = outermost(units)
    layers, found = 0, set()
    for name, _ in model.named_modules():
        parent, _, index = name.rpartition(".")
        if not index.isdigit() or any(part.isdigit() for part in parent.split(".")):
            continue
        if not isinstance(model.get_submodule(parent), nn.ModuleList):
            continue
        layers += 1
        if any(name == unit or name.startswith(unit + ".") for unit in top):
            found.add(int(index))
    if moe and plan.activation_checkpointing != "none":
        why = "a mixture of experts' routing breaks the graph inside the checkpointed region, so dynamo runs it eagerly"
        return frozenset(), f"torch.compile: the decoder layers are counted as eager: {why}."
    if len(found) < layers:
        return frozenset(found), (
            f"torch.compile: {layers - len(found)} of {layers} decoder layers are counted as eager: the plan compiles"
            " its outermost FSDP units, and these layers are not inside one whole."
        )
    return frozenset(found), ""
