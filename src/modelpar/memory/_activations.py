"""Bytes autograd keeps for backward in a decoder's training step, from the model's sizes and the plan.

Every term below was read off what the model code saves (``torch.autograd.graph.saved_tensors_hooks``, each
storage once) and checked against the bytes live after forward on CPU (``benchmarks/calibrate_estimate.py``,
``docs/memory.md``). Notation: ``b`` micro-batch, ``s`` local tokens (sequence / context-parallel size), ``d``
hidden size, ``f`` FFN hidden size, ``h`` / ``g`` query / key-value heads and ``e`` head dim (each split by the
tensor-parallel size ``tp``), ``a`` the activation dtype's bytes (the mixed-precision ``param_dtype``), ``V``
the vocabulary. With sequence parallelism the norms and the residual stream run on ``s / tp`` tokens.

Per decoder layer, without checkpointing:

- each RMSNorm (two per layer, plus the final one) keeps its input as fp32 (the fp32 input itself, or under
  16-bit activations the ``.float()`` copies the norm makes: two in ``modelpar.models.Llama``, which calls it
  twice, one in Hugging Face's), the ``rsqrt`` per token (fp32), and the normalized value before the weight
  multiply (fp32, or its cast to ``a``); its output, the projections' input, is kept once at ``a`` (all-gathered
  to ``s`` tokens under sequence parallelism);
- per-head q / k norms (Qwen3) keep the same on the projections' outputs;
- attention keeps q, k and v as the kernel sees them (k and v repeated to ``h`` heads when the model repeats
  them before the kernel, as ``modelpar.models.Llama`` does; ``g`` heads when the kernel does grouped-query
  attention itself, as Hugging Face's SDPA path does), its output and its log-sum-exp (fp32, per head and token);
- the SwiGLU MLP keeps the gate and up projections' outputs, the SiLU output and their product: ``4 b s f a``;
  a mixture-of-experts layer keeps its router's and experts' tensors instead (:mod:`modelpar.memory._moe`).

``"full"`` checkpointing keeps only each checkpointed layer's input (``b s d a``); ``"selective"`` keeps the
layer input and the outputs of the ops in ``plans._checkpointing.SAVED_OPS``: the q/k/v, output, gate, up and
down projections (the row-parallel ones before their all-reduce: ``b s d a`` each) and attention's output and
log-sum-exp. Outside the layers: the token ids (int64), the final norm, the LM head's input, the logits the
step holds (``b s V a``; ``V / tp`` under loss parallelism) and the cross-entropy's fp32 log-probabilities.
Under context parallelism (``modelpar.context``'s kernel) each attention layer keeps the all-gathered K and V of
the whole sequence (:func:`cp_gathered_kv`) instead of the local ones, its output once more (the kernel joins its
two query chunks head-major, so the projection's input is a copy), and ``modelpar.models.Llama``'s RoPE keeps
cos / sin indexed by position (``2 x 2 x b s e/2`` fp32 per layer).

The layers a plan compiles (``ParallelPlan(compile=True)``) keep less: inductor's partitioner recomputes the
pointwise chains (the norms' casts and normalization, SiLU, RoPE) and keeps the rest
(:mod:`modelpar.memory._compiled`); outside the layers nothing changes.

Float8 training (:mod:`modelpar.memory._float8`) keeps the same bytes in eager layers (a float8 linear layer saves its
high-precision input, as ``nn.Linear`` does) and less in compiled ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypedDict

from torch import nn

from modelpar.memory._compiled import LayerTerms, compiled_terms, float8_saving
from modelpar.memory._moe import MoEShape, moe_layer_bytes, moe_shape
from modelpar.plans._plan import ParallelPlan

__all__ = [
    "ActivationEstimate",
    "ActivationSetting",
    "DecoderShape",
    "activation_bytes",
    "check_sequence",
    "cp_gathered_kv",
    "decoder_shape",
    "setting_label",
]

_FP32 = 4
_INDEX = 8  # int64 token ids


@dataclass(frozen=True)
class DecoderShape:
    """The sizes of a Llama-style decoder that its activations depend on, and how its code keeps them."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    norm_fp32_copies: int  # `.float()` copies an RMSNorm keeps under 16-bit activations
    repeats_kv: bool  # K and V repeated to every query head before the attention kernel
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    rope_tables: bool  # cos / sin computed per forward and kept once (Hugging Face)
    moe: MoEShape | None = None  # the MoE layers (modelpar.memory._moe), None for a dense model


class ActivationSetting(TypedDict):
    """What sizes the activations besides the batch and sequence: :func:`activation_bytes`' keyword arguments."""

    act_bytes: int
    tp: int
    cp: int
    sequence_parallel: bool
    loss_parallel: bool
    checkpointing: str
    ac_every: int
    compiled: frozenset[int]
    float8: frozenset[int]


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one rank keeps from forward for backward (``stored``), by part, and the backward-time extras."""

    parts: tuple[tuple[str, int], ...]
    recompute: int  # one checkpointed layer's activations, rebuilt during its backward
    loss_backward: int  # the cross-entropy's gradients, at the start of backward
    layers: int = 0
    compiled_layers: int = 0  # layers counted as compiled (torch.compile, inductor's partitioner), the rest eager
    float8_saved: int = 0  # what compiled float8 layers keep less than compiled high-precision ones

    @property
    def stored(self) -> int:
        return sum(size for _, size in self.parts)


def decoder_shape(model: nn.Module) -> DecoderShape:
    """The :class:`DecoderShape` of ``modelpar.models.Llama`` or a Hugging Face Llama-style causal LM."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "ffn_hidden") and hasattr(config, "n_heads"):  # modelpar Llama
        return DecoderShape(
            layers=config.n_layers,
            hidden=config.dim,
            heads=config.n_heads,
            kv_heads=config.n_kv_heads,
            head_dim=config.dim // config.n_heads,
            ffn=config.ffn_hidden,
            vocab=config.vocab_size,
            norm_fp32_copies=2,
            repeats_kv=True,
            qk_norm=False,
            rope_tables=False,
            moe=moe_shape(model),
        )
    needed = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers", "vocab_size")
    if config is None or not all(isinstance(getattr(config, k, None), int) for k in needed):
        raise ValueError(
            f"estimate_memory(seq_len=...) counts activations of Llama-style decoders (modelpar.models.Llama, or a"
            f" Hugging Face model whose config has {', '.join(needed)}), but {type(model).__name__} has no such"
            " config. Leave `seq_len=None` for the model state alone."
        )
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    attention = getattr(config, "_attn_implementation", None) or "sdpa"
    return DecoderShape(
        layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        ffn=config.intermediate_size,
        vocab=config.vocab_size,
        norm_fp32_copies=1,
        repeats_kv=attention == "eager",
        qk_norm=any(name.endswith("self_attn.q_norm") for name, _ in model.named_modules()),
        rope_tables=True,
        moe=moe_shape(model),
    )


def _norm(rows: int, width: int, a: int, copies: int) -> int:
    """An RMSNorm's own saved tensors: fp32 input (or copies), per-row rsqrt, the normalized value."""
    kept_input = _FP32 if a == _FP32 else _FP32 * copies
    normalized = _FP32 if a == _FP32 else a
    return rows * width * (kept_input + normalized) + rows * _FP32


def cp_gathered_kv(shape: DecoderShape, *, batch: int, seq_len: int, tp: int, a: int) -> int:
    """Per attention layer under context parallelism: the K and V of the whole sequence, all-gathered and kept.

    ``2 b S (g / tp) e a``: key-value heads only, as ``modelpar.context``'s kernel gathers them and SDPA shares
    them among query heads (``enable_gqa``). Calibrated at cp = 2 (``tests/distributed/test_estimate.py``). On
    CUDA with a padding mask the kernel repeats the heads first (``share_kv_heads_in_sdpa``): ``h`` for ``g``,
    which this term does not count.
    """
    return 2 * batch * seq_len * (shape.kv_heads // tp) * shape.head_dim * a


def activation_bytes(
    shape: DecoderShape,
    *,
    batch: int,
    seq_len: int,
    act_bytes: int,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    checkpointing: str = "none",
    ac_every: int = 1,
    compiled: frozenset[int] = frozenset(),
    float8: frozenset[int] = frozenset(),
    layer_ids: Sequence[int] | None = None,
    first: bool = True,
    last: bool = True,
) -> ActivationEstimate:
    """What one rank keeps from forward for backward, by part (see the module docstring for each term).

    ``compiled``: indices of the layers the plan compiles, counted as inductor's partitioner keeps them
    (:mod:`modelpar.memory._compiled`); those of them in ``float8`` (linear layers in float8) keep less when not
    checkpointed (:func:`~modelpar.memory._compiled.float8_saving`). A pipeline stage counts its own layers
    (``layer_ids``; ``ac_every`` counts them from the stage's first, as the plan applied to the stage does), the token
    ids only when it is the ``first`` and the final norm, logits and loss only when it is the ``last``.
    """
    a, s = act_bytes, seq_len // cp
    rows = batch * s
    stream_rows = rows // tp if sequence_parallel else rows
    d, f = shape.hidden, shape.ffn // tp
    h, g, e = shape.heads // tp, shape.kv_heads // tp, shape.head_dim
    # Under context parallelism the kernel (modelpar.context) does grouped-query attention inside SDPA and sees
    # the gathered K/V (a separate term); the local K/V are not kept, and the output is copied once more into
    # the projection's layout (the kernel concatenates its two query chunks head-major).
    kv_seen = 0 if cp > 1 else (h if shape.repeats_kv else g)
    cp_extra = rows * h * e * a if cp > 1 else 0
    if cp > 1 and not shape.rope_tables:  # modelpar's RoPE indexes cos / sin by position: 2 calls x 2 tables
        cp_extra += 2 * 2 * rows * (e // 2) * _FP32
    copies = shape.norm_fp32_copies

    norms = 2 * _norm(stream_rows, d, a, copies) + 2 * rows * d * a  # two norms and the projections' inputs
    if shape.qk_norm:
        norms += _norm(rows * h, e, a, copies) + _norm(rows * g, e, a, copies)
    attention = rows * e * (2 * h + 2 * kv_seen) * a + batch * h * s * _FP32 + cp_extra
    mlp = 4 * rows * f * a
    layer_input = stream_rows * d * a
    selective_attention = layer_input + rows * e * (h + 2 * g) * a + rows * d * a + rows * h * e * a
    selective_attention += batch * h * s * _FP32
    cp_kv = cp_gathered_kv(shape, batch=batch, seq_len=seq_len, tp=tp, a=a) if cp > 1 else 0
    eager = LayerTerms(norms=norms, mlp=mlp, mlp_selective=rows * d * a + 2 * rows * f * a)
    inductor = compiled_terms(rows=rows, stream_rows=stream_rows, d=d, f=f, h=h, g=g, e=e, a=a, qk_norm=shape.qk_norm)
    ids = list(range(shape.layers)) if layer_ids is None else sorted(layer_ids)
    dense = kept = moe = checkpointed = recompute = float8_saved = 0
    for position, index in enumerate(ids, start=1):
        terms = inductor if index in compiled else eager
        is_moe = shape.moe is not None and index in shape.moe.layer_ids
        ffn = _moe_ffn(shape, rows, a, "none") if is_moe else terms.mlp
        ffn_selective = _moe_ffn(shape, rows, a, "selective") if is_moe else terms.mlp_selective
        if checkpointing == "none" or position % ac_every:
            saved = float8_saving(rows=rows, d=d, f=f, a=a, moe=is_moe) if index in compiled & float8 else 0
            float8_saved += saved
            dense += terms.norms + attention + (0 if is_moe else ffn) - saved
            moe += ffn if is_moe else 0
            continue
        checkpointed += 1
        everything = terms.norms + attention + ffn + cp_kv
        if checkpointing == "full":
            kept += layer_input
            recompute = max(recompute, everything - layer_input)
        else:
            kept += selective_attention + (0 if is_moe else ffn_selective)
            moe += ffn_selective if is_moe else 0
            recompute = max(recompute, everything - selective_attention - ffn_selective)
    n_moe = len(set(shape.moe.layer_ids) & set(ids)) if shape.moe is not None else 0
    moe_name = f"MoE feed-forwards ({n_moe} layer{'s' * (n_moe != 1)})"

    vocab = shape.vocab // tp if loss_parallel else shape.vocab
    parts = [("token ids", rows * _INDEX * first)]
    parts += [
        ("layers, not checkpointed", dense),
        (f"layers, {checkpointing} checkpointing", kept),
        ("cp gathered K/V", (len(ids) - checkpointed) * cp_kv),
        (moe_name, moe),
    ]
    if last:
        parts += [
            ("final norm, LM head input", _norm(stream_rows, d, a, copies) + rows * d * a),
            ("logits", rows * vocab * a),
            ("log-probabilities (fp32)", rows * vocab * _FP32),
        ]
    if shape.rope_tables:
        parts.append(("rotary cos/sin", 2 * s * e * a))
    return ActivationEstimate(
        parts=tuple((name, size) for name, size in parts if size),
        recompute=recompute,
        loss_backward=2 * rows * vocab * _FP32 * last,
        layers=len(ids),
        compiled_layers=len(compiled & set(ids)),
        float8_saved=float8_saved,
    )


def _moe_ffn(shape: DecoderShape, rows: int, a: int, checkpointing: str) -> int:
    assert shape.moe is not None  # only called for MoE layers
    return moe_layer_bytes(shape.moe, rows=rows, dim=shape.hidden, a=a, checkpointing=checkpointing)


def check_sequence(seq_len: int | None, batch: int, cp: int, tp: int, plan: ParallelPlan) -> int:
    """Validate the activation arguments; return the context-parallel size."""
    for name, value in (("seq_len", seq_len), ("micro_batch_size", batch), ("context_parallel_size", cp)):
        if value is None and name == "seq_len":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"estimate_memory({name}={value!r}) must be a positive int.")
    if seq_len is not None:
        sp = tp if plan.sequence_parallel and tp > 1 else 1
        parts = (2 * cp if cp > 1 else 1) * sp
        if seq_len % parts:
            what = [f"2 x context_parallel_size={cp} (two load-balanced chunks per rank)"] * (cp > 1)
            what += [f"tensor_parallel_size={tp} (sequence parallel)"] * (sp > 1)
            raise ValueError(
                f"estimate_memory(seq_len={seq_len}) must divide by {' x '.join(what)} = {parts}: each rank holds an"
                " equal share of the tokens. Choose a sequence length that is a multiple of it."
            )
    return cp


def setting_label(plan: ParallelPlan, seq_len: int | None, batch: int, cp: int, tp: int, dtype: str) -> str:
    """The activation setting in a few words, for the table."""
    if seq_len is None:
        return ""
    extras = [f"AC {plan.activation_checkpointing}"]
    extras += [f"every {plan.ac_every}"] * (plan.activation_checkpointing != "none" and plan.ac_every > 1)
    extras += ["SP"] * (plan.sequence_parallel and tp > 1) + ["LP"] * (plan.loss_parallel and tp > 1)
    extras += [f"cp {cp}"] * (cp > 1)
    return f"b {batch} x seq {seq_len}, {dtype}, {', '.join(extras)}"
