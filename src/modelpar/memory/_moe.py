"""Mixture-of-experts terms of the memory estimate: where the experts are, what a MoE layer keeps, the all-to-all.

A MoE module, for the estimate, is a module with an ``experts`` submodule of fused 3-D ``[E, ...]`` weights:
``modelpar.models.moe.MoE`` (``w1``, ``w3`` ``[E, hidden, dim]``, ``w2`` ``[E, dim, hidden]``) and Hugging Face's
experts (``gate_up_proj`` ``[E, 2 hidden, dim]``, ``down_proj`` ``[E, dim, hidden]``: Qwen3-MoE, Mixtral ...).

**State under expert parallelism** (``ep > 1``, as ``modelpar.moe.parallelize_experts`` does it): each expert
weight is split along dim 0 over the expert axis (``E / ep`` whole experts per rank), then FSDP-sharded over the
``dp_shard / ep`` ranks holding the same experts (:attr:`MeshLayout.expert_shard_size`), in padded chunks as
``fully_shard`` pads them; the experts are their own FSDP unit, gathered over those ranks only (``E / ep`` experts
full size). At ``ep = 1`` they are part of their block's unit, like any weight (split whole over the
tensor-parallel ranks, ``E / tp`` each, under transformers' ``moe_tp_experts``).

**Activations of a MoE layer**, read off what autograd saves (``saved_tensors_hooks``) on one MoE layer of each
implementation, ``T`` tokens, ``K = T x top_k`` routed copies, ``d`` hidden, ``H`` expert hidden, ``a`` the
activation dtype's bytes. Routing is dropless, so one process keeps the same bytes however the tokens spread over
the experts (the experts together run on exactly ``K`` rows); under expert parallelism a rank receives ``K`` rows
when routing is **balanced**, which the estimate assumes (an overloaded rank receives more: not modelled).

- ``modelpar.models.moe.MoE``: router logits and probabilities (fp32, ``T x E`` each), the log-sum-exp and the
  top-k weights' sum (fp32, ``T``), the top-k weights (fp32) and ids (int64, ``T x k``), two int64 ``K`` orders,
  the routed copies (``K d a``), each expert's SwiGLU intermediates on its tokens (``4 K H a``: gate and up
  projections, the SiLU, their product), the combined expert outputs twice (``2 K d a``: the weighting multiply
  and ``index_add``) and the per-copy weights (``K a``).
- Hugging Face (``grouped_mm``, the default experts implementation): probabilities (fp32, ``T x E``), top-k ids
  (int64), three int64 ``K`` permutations, the sorted copies (``K d a``), the fused gate-up output (``2 K H a``),
  the SiLU and the product (``2 K H a``), the down projection's output (``K d a``), the per-copy weights (``K a``).

Under ``"selective"`` checkpointing a MoE layer keeps its router's output (``T E a``), and for modelpar's MoE each
expert's three matmul outputs (``2 K H a + K d a``): the ``mm`` ops of ``SAVED_OPS``; Hugging Face's grouped
matmuls are recomputed.

**All-to-all buffers** (``ep > 1``): each dispatch and each combine sends ``K`` rows of ``d`` and receives as many
(balanced), ``2 K d a`` per all-to-all, one at a time, in forward and again in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

__all__ = [
    "MoEShape",
    "all_to_all_bytes",
    "expert_modules",
    "expert_units",
    "moe_layer_bytes",
    "moe_notes",
    "moe_shape",
    "refuse_hugging_face_experts",
]

_FP32 = 4
_INDEX = 8


@dataclass(frozen=True)
class MoEShape:
    """The sizes of a model's MoE layers that their activations depend on (all MoE layers alike)."""

    layer_ids: frozenset[int]  # indices of the decoder layers whose feed-forward is a MoE
    n_experts: int
    top_k: int
    hidden: int  # each expert's SwiGLU hidden size
    hugging_face: bool  # Hugging Face's experts implementation (grouped_mm), else modelpar.models.moe.MoE


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` of the MoE modules of ``model``: those with an ``experts`` child of fused 3-D weights."""
    found = {}
    for name, module in model.named_modules():
        experts = getattr(module, "experts", None)
        if isinstance(experts, nn.Module):
            params = list(experts.parameters(recurse=False))
            if params and all(p.ndim == 3 for p in params):
                found[name] = module
    return found


def _layer_index(name: str) -> int:
    """The decoder layer a module belongs to: the first integer in its name (``model.layers.3.mlp`` -> 3)."""
    return next((int(part) for part in name.split(".") if part.isdigit()), 0)


def _top_k(module: nn.Module, model: nn.Module) -> int:
    for holder in (module, getattr(module, "gate", None), getattr(module, "router", None)):
        value = getattr(holder, "top_k", None)
        if isinstance(value, int):
            return value
    value = getattr(getattr(model, "config", None), "num_experts_per_tok", None)
    if isinstance(value, int):
        return value
    raise ValueError(
        f"{type(module).__name__} looks like a mixture of experts, but the estimate finds no `top_k` on it, its gate"
        " or router, nor `num_experts_per_tok` in the model's config. Leave `seq_len=None` for the model state alone."
    )


def moe_shape(model: nn.Module) -> MoEShape | None:
    """The :class:`MoEShape` of ``model``'s MoE layers, or ``None`` for a dense model."""
    modules = expert_modules(model)
    if not modules:
        return None
    module = next(iter(modules.values()))
    experts = module.experts
    assert isinstance(experts, nn.Module)  # expert_modules checked it
    down = getattr(experts, "w2", None)
    if down is None:
        down = getattr(experts, "down_proj", None)
    if not isinstance(down, nn.Parameter):
        raise ValueError(
            f"{type(experts).__name__}: the estimate knows fused experts with a `w2` (modelpar) or `down_proj` (Hugging"
            " Face) weight [E, dim, hidden]. Leave `seq_len=None` for the model state alone."
        )
    return MoEShape(
        layer_ids=frozenset(_layer_index(name) for name in modules),
        n_experts=down.shape[0],
        top_k=_top_k(module, model),
        hidden=down.shape[2],
        hugging_face=not hasattr(experts, "w2"),
    )


def moe_notes(shape: object, expert_parallel_size: int) -> set[str]:
    """What the table says about a MoE model's activations (``shape``: the model's ``DecoderShape`` or ``None``)."""
    moe = getattr(shape, "moe", None)
    if moe is None:
        return set()
    notes = {
        f"MoE ({moe.n_experts} experts, top-{moe.top_k}): balanced routing assumed, dropless (no capacity); an"
        " overloaded expert's rank keeps more activations than counted."
    }
    if expert_parallel_size > 1:
        notes.add(
            "all-to-all buffers: each dispatch and combine sends and receives tokens x top_k x dim (balanced),"
            " counted in the experts' backward, one at a time."
        )
    return notes


def moe_layer_bytes(shape: MoEShape, *, rows: int, dim: int, a: int, checkpointing: str) -> int:
    """What one MoE layer's feed-forward keeps for backward on ``rows`` tokens (see the module docstring)."""
    t, e, k, h = rows, shape.n_experts, shape.top_k, shape.hidden
    copies = t * k
    if checkpointing == "selective":
        kept = t * e * a
        return kept if shape.hugging_face else kept + copies * (2 * h + dim) * a
    experts = 4 * copies * h * a
    if shape.hugging_face:
        router = t * e * _FP32 + t * k * _INDEX + 3 * copies * _INDEX + e * _FP32
        return router + experts + 2 * copies * dim * a + copies * a
    router = 2 * t * e * _FP32 + 2 * t * _FP32 + t * k * (_FP32 + _INDEX) + 2 * copies * _INDEX
    return router + experts + 3 * copies * dim * a + copies * a


def all_to_all_bytes(shape: MoEShape, *, rows: int, dim: int, a: int) -> int:
    """One token all-to-all's send and receive buffers on one rank, balanced routing: ``2 x rows x top_k x dim x a``."""
    return 2 * rows * shape.top_k * dim * a


def expert_units(model: nn.Module, patterns: tuple[str, ...], expert_parallel_size: int) -> dict[str, str]:
    """``{experts submodule name: its FSDP unit}`` under expert parallelism; empty at ``expert_parallel_size = 1``.

    ``patterns`` are the plan's ``experts`` (already checked by ``ParallelPlan.check``); each MoE module's
    ``experts`` becomes its own FSDP unit, as ``modelpar.moe.parallelize_experts`` makes it.
    """
    if expert_parallel_size == 1:
        return {}
    from modelpar.plans._experts import experts_name, moe_modules

    names = [experts_name(model, name) for name in moe_modules(model, patterns, expert_parallel_size)]
    return {name: name for name in names}


def refuse_hugging_face_experts(model: nn.Module, patterns: tuple[str, ...], expert_parallel_size: int) -> None:
    """Raise ``ValueError`` for expert parallelism on a model whose MoE modules the plan does not name (HF's)."""
    if expert_parallel_size > 1 and not patterns and expert_modules(model):
        raise ValueError(
            f"`expert_parallel_size={expert_parallel_size}`: the plan names none of {type(model).__name__}'s MoE"
            " modules in `experts`, so nothing would be split over the expert axis. Use `modelpar.hf.plan_for`'s"
            " plan (it names transformers' experts modules), add them to `ParallelPlan(experts=...)`, or estimate"
            " with `expert_parallel_size=1` (`--ep 1`)."
        )
