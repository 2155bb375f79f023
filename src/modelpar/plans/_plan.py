"""A declarative parallelization plan: what to shard, how, and which blocks to checkpoint and compile.

One frozen :class:`ParallelPlan` per model family says it all in data; calling it on a model and the
strategy's mesh applies it in torchtitan's order. The plan is itself a ``parallelize_fn``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, get_args

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ParallelStyle

from modelpar._mesh.submeshes import context_parallel_mesh
from modelpar._train.fsdp import fsdp_kwargs
from modelpar.moe._layout import expert_parallel_mesh
from modelpar.plans._checkpointing import checkpoint_module
from modelpar.plans._checks import (
    check_divisible,
    check_layers_sharded,
    check_refused,
    resolve_styles,
    resolve_units,
)
from modelpar.plans._context import apply_context_parallel, attention_modules, is_hugging_face
from modelpar.plans._experts import apply_experts, drop_expert_styles, moe_modules
from modelpar.plans._styles import COLUMN_STYLES, STYLES, StyleSpec, apply_style
from modelpar.plans._units import ModuleSelector, normalize_selector, outermost

if TYPE_CHECKING:  # imported lazily below: modelpar.float8 builds on this package
    from modelpar.float8 import Float8Recipe, Float8Training

__all__ = ["ActivationCheckpointing", "ParallelPlan"]

ActivationCheckpointing = Literal["none", "full", "selective"]
_TP_AXIS = "tensor_parallel"


@dataclass(frozen=True, kw_only=True)
class ParallelPlan:
    """How to parallelize one model family: tensor parallelism, FSDP units, activation checkpointing, compile.

    Call it as a ``parallelize_fn``: ``ModelParallelStrategy(LLAMA_PLAN)``, or ``plan(model, device_mesh)``
    in ``configure_model``. It applies, in this order: the pre-flight checks (:meth:`check`), tensor
    parallelism on ``device_mesh["tensor_parallel"]`` (skipped when that axis has one rank), activation
    checkpointing, ``torch.compile``, then ``fully_shard`` bottom-up (every unit, the deepest first, then the
    root) with ``**modelpar.fsdp_kwargs(device_mesh)``, so the strategy's FSDP2 policies and the HSDP mesh
    apply. Toggle an option with :meth:`replace`: ``LLAMA_PLAN.replace(sequence_parallel=True)``.

    Attributes:
        tensor_parallel: submodule pattern -> style. A pattern is matched against submodule names segment by
            segment with ``fnmatch`` (``*`` stands for one segment and never crosses a dot), so
            ``"layers.*.attention.wq"`` names every block's query projection. A style is one of the names
            below or a DTensor ``ParallelStyle``, applied as given on the tensor-parallel mesh. Activations
            are ``(batch, sequence, ...)``; "the stream" is the residual stream between blocks: replicated
            on the tensor-parallel ranks, or sharded along the sequence (``Shard(1)``) with ``sequence_parallel``.

            ============== ===================================================================================
            name           DTensor meaning
            ============== ===================================================================================
            colwise        ``ColwiseParallel()``: ``nn.Linear`` weight ``Shard(0)``; replicated input; output
                           sharded on its last dim (local tensor). Hugging Face ``"colwise"``.
            rowwise        ``RowwiseParallel(output_layouts=<stream>)``: weight ``Shard(1)``; input sharded on
                           its last dim; output all-reduced (replicated), or reduce-scattered to ``Shard(1)``
                           with sequence parallelism. Hugging Face ``"rowwise"``.
            colwise_gather ``ColwiseParallel(output_layouts=Replicate())``: column-parallel, output all-gathered
                           (a plain, non-view tensor). Hugging Face ``"colwise_gather_output"``.
            embedding      ``RowwiseParallel(input_layouts=Replicate(), output_layouts=<stream>)`` on
                           ``nn.Embedding``: vocab-parallel (rows ``Shard(0)``), token ids replicated, output
                           all-reduced, or reduce-scattered to ``Shard(1)``. Hugging Face ``"embedding_rowwise"``.
            output         The LM head, ``ColwiseParallel(input_layouts=<stream>, ...)``: with ``loss_parallel``,
                           ``output_layouts=Shard(-1), use_local_output=False`` (vocab-sharded DTensor logits,
                           for :func:`loss_parallel`); otherwise ``output_layouts=Replicate()`` (all-gathered
                           plain logits, not a view, safe for in-place ops).
            norm           ``SequenceParallel()`` with ``sequence_parallel`` (parameters replicated, computed
                           on the ``Shard(1)`` sequence shard, DTensor output); nothing otherwise. Hugging Face
                           ``"sequence_parallel"``.
            sequence_gather For a block's attention / MLP container, with ``sequence_parallel``: all-gather its
                           first input from ``Shard(1)`` to a replicated DTensor before the column-parallel
                           projections inside (one all-gather forward, one reduce-scatter of the summed
                           gradient backward; torchtitan's ``PrepareModuleInput``); nothing otherwise.
            ============== ===================================================================================

        fsdp_units: the submodules that become FSDP units: patterns (``("layers.*",)``), module classes as FSDP1's
            ``ModuleWrapPolicy`` took them (``{TransformerBlock}``), or a predicate ``(module) -> bool``. The root is
            always sharded last, so a plan with no units shards the whole model as one.
        activation_checkpointing: ``"none"``; ``"full"``: recompute every activation of a unit in backward;
            ``"selective"``: keep the outputs of matrix multiplies and attention, recompute the rest. Applied
            to the outermost FSDP units, with ``torch.utils.checkpoint`` (non-reentrant) and no wrapper
            module, so parameter and checkpoint names do not change. Or the modules to checkpoint fully, by
            class (``{TransformerBlock}``, as FSDP1's ``activation_checkpointing_policy``), by patterns or by a
            predicate, whether or not they are FSDP units (the outermost of them; ``ac_every`` counts those).
        ac_every: checkpoint every k-th of those units (the k-th, 2k-th, ...; 1: all of them).
        compile: ``torch.compile`` each outermost FSDP unit (``module.compile()``: names do not change).
        sequence_parallel: shard the stream along the sequence between the tensor-parallel regions (norms
            and residual adds on ``seq / tp`` tokens; the sequence length must divide by the TP size).
        loss_parallel: keep the logits vocab-sharded; compute the loss inside :func:`loss_parallel`.
        reshard_after_forward, mp_policy: ``fully_shard`` options that override the strategy's (``None``: the
            strategy's, see :func:`modelpar.fsdp_kwargs`).
        attention: patterns of the attention modules that run on sequence shards under context parallelism
            (``context_parallel_size > 1``): each exposes its kernel as an ``attention_kernel`` attribute, which
            the plan replaces with :class:`modelpar.context.ContextParallelAttention`. Hugging Face models need
            none (their attention is switched through transformers' registry). Unused without context parallelism.
        experts: patterns of the mixture-of-experts modules (``("layers.*.moe",)``): each has a ``dispatch``
            attribute and an ``experts`` submodule of fused ``[n_experts, ...]`` weights (``modelpar.models.moe.MoE``).
            Under ``expert_parallel_size > 1`` their experts are split over the expert axis and FSDP-sharded over
            the ranks holding the same experts, tokens travel by all-to-all; with several token ranks their router
            statistics are summed over them (global-batch auxiliary losses). Or transformers' experts modules
            themselves (``"model.layers.*.mlp.experts"``, as ``modelpar.hf.plan_for`` names them). Under expert
            parallelism, tensor-parallel styles on these modules give way: their experts are whole on each rank.
            See docs/moe.md.
        float8: train the ``nn.Linear`` layers in float8 with torchao (the ``float8`` extra): a recipe name
            (``"tensorwise"``, ``"rowwise"``, ``"rowwise_with_gw_hp"``) or a :class:`modelpar.float8.Float8Training`
            that also says which layers, whether FSDP2 all-gathers in float8, and whether to emulate the kernels.
            Applied first, on the meta device (float8 -> TP -> activation checkpointing -> compile -> FSDP); the
            LM head and layers the kernels cannot take stay in high precision. See docs/float8.md.
    """

    tensor_parallel: Mapping[str, StyleSpec] = field(default_factory=dict)
    fsdp_units: ModuleSelector = ()
    activation_checkpointing: ActivationCheckpointing | ModuleSelector = "none"
    ac_every: int = 1
    compile: bool = False
    sequence_parallel: bool = False
    loss_parallel: bool = False
    reshard_after_forward: bool | int | None = None
    mp_policy: MixedPrecisionPolicy | None = None
    attention: tuple[str, ...] = ()
    experts: tuple[str, ...] = ()
    float8: Float8Training | Float8Recipe | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tensor_parallel, Mapping):
            raise TypeError(
                "ParallelPlan(tensor_parallel=...) must be a mapping of submodule pattern -> style, but got"
                f" {type(self.tensor_parallel).__name__}."
            )
        for pattern, style in self.tensor_parallel.items():
            if not isinstance(pattern, str) or not pattern:
                raise TypeError(
                    f"ParallelPlan.tensor_parallel: a pattern must be a non-empty str, but got {pattern!r}."
                )
            if isinstance(style, str):
                if style not in STYLES:
                    raise ValueError(
                        f"ParallelPlan.tensor_parallel: {pattern!r} has the unknown style {style!r}. Use one of"
                        f" {list(STYLES)}, or a `torch.distributed.tensor.parallel.ParallelStyle`."
                    )
            elif not isinstance(style, ParallelStyle):
                raise TypeError(
                    f"ParallelPlan.tensor_parallel: {pattern!r} maps to {type(style).__name__}; a style is one of"
                    f" {list(STYLES)} or a `torch.distributed.tensor.parallel.ParallelStyle`."
                )
        object.__setattr__(self, "fsdp_units", normalize_selector(self.fsdp_units, "ParallelPlan", "fsdp_units"))
        if isinstance(self.attention, str) or not all(isinstance(p, str) and p for p in self.attention):
            raise TypeError(
                f"ParallelPlan(attention={self.attention!r}) must be a tuple of non-empty patterns, such as"
                " ('layers.*.attention',)."
            )
        if isinstance(self.experts, str) or not all(isinstance(p, str) and p for p in self.experts):
            raise TypeError(
                f"ParallelPlan(experts={self.experts!r}) must be a tuple of non-empty patterns, such as"
                " ('layers.*.moe',)."
            )
        if not isinstance(self.activation_checkpointing, str):
            object.__setattr__(
                self,
                "activation_checkpointing",
                normalize_selector(self.activation_checkpointing, "ParallelPlan", "activation_checkpointing"),
            )
        elif self.activation_checkpointing not in get_args(ActivationCheckpointing):
            raise ValueError(
                f"ParallelPlan(activation_checkpointing={self.activation_checkpointing!r}) is not a mode. Use one"
                f" of {list(get_args(ActivationCheckpointing))}. Or name the modules to checkpoint: classes such as"
                " {TransformerBlock}, patterns, or a predicate."
            )
        if isinstance(self.ac_every, bool) or not isinstance(self.ac_every, int) or self.ac_every < 1:
            raise ValueError(
                f"ParallelPlan(ac_every={self.ac_every!r}) must be a positive int: checkpoint every k-th FSDP unit"
                " (1 for all of them)."
            )
        wants_units = [f"activation_checkpointing={self.activation_checkpointing!r}"] * (
            self.activation_checkpointing in ("full", "selective")
        ) + ["compile=True"] * bool(self.compile)
        if wants_units and not self.fsdp_units:
            raise ValueError(
                f"ParallelPlan({', '.join(wants_units)}) applies to the FSDP units, but `fsdp_units` is empty. Name"
                " the blocks, e.g. `fsdp_units=('layers.*',)`."
            )
        if self.loss_parallel and "output" not in self.tensor_parallel.values():
            raise ValueError(
                "ParallelPlan(loss_parallel=True) keeps the LM head's logits vocab-sharded, but no submodule has the"
                " style 'output'. Map the LM head to 'output' (e.g. `{'output': 'output'}`), or turn loss"
                " parallelism off."
            )
        if self.float8 is not None:  # imported only then: modelpar.float8 builds on this package
            from modelpar.float8._spec import float8_spec

            object.__setattr__(self, "float8", float8_spec(self.float8, "ParallelPlan"))
        # Frozen means frozen: a read-only copy, so a plan shared between runs cannot be changed under them.
        object.__setattr__(self, "tensor_parallel", MappingProxyType(dict(self.tensor_parallel)))
        object.__setattr__(self, "attention", tuple(self.attention))
        object.__setattr__(self, "experts", tuple(self.experts))

    def replace(self, **changes: Any) -> ParallelPlan:
        """A copy with ``changes`` applied (``dataclasses.replace``), validated like a new plan."""
        return dataclasses.replace(self, **changes)

    def check(
        self,
        model: nn.Module,
        tensor_parallel_size: int,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
    ) -> None:
        """Raise, before anything is sharded, if this plan cannot apply to ``model`` at this TP size.

        Every pattern matches a submodule; no submodule gets two styles; each named style fits its module's
        type (:class:`~modelpar.UnsupportedStyleError` otherwise); with ``sequence_parallel`` every
        column-parallel projection sits under a ``"sequence_gather"`` container; each dimension a style splits
        (``out_features`` for the column-parallel styles, ``in_features`` for ``"rowwise"``, ``num_embeddings``
        for ``"embedding"``) and the head counts in ``model.config`` (``n_heads``, ``num_attention_heads``,
        ``n_kv_heads``, ``num_key_value_heads``) divide by ``tensor_parallel_size``; with
        ``tensor_parallel_size > 1``, a style splits a weight inside some FSDP unit (a decoder layer), since
        otherwise every layer is replicated on each tensor-parallel rank; with ``context_parallel_size > 1``,
        every attention can be put on sequence shards (the ``attention`` patterns, or a Hugging Face model); with
        ``expert_parallel_size > 1``, the ``experts`` patterns name MoE modules whose experts (and ``top_k``) fit;
        with ``float8``, the layers it selects are linear layers the float8 kernels can take (sizes per
        tensor-parallel rank multiples of 16) and not fused experts (``NotImplementedError``).
        Errors are ``ValueError`` unless said otherwise. Works on a meta-device model with no process group,
        identically on every rank.
        """
        self._resolve(model, tensor_parallel_size, context_parallel_size, expert_parallel_size)

    def _resolve(
        self, model: nn.Module, tensor_parallel_size: int, context_parallel_size: int = 1, expert_parallel_size: int = 1
    ) -> tuple[dict[str, StyleSpec], list[str]]:
        if context_parallel_size > 1 and not is_hugging_face(model):
            attention_modules(model, self.attention)
        moes = moe_modules(model, self.experts, expert_parallel_size)
        styles = resolve_styles(model, self.tensor_parallel, sequence_parallel=self.sequence_parallel)
        if expert_parallel_size > 1:
            styles = drop_expert_styles(styles, moes)
        units = resolve_units(model, self.fsdp_units)
        check_refused(styles, tensor_parallel_size)
        check_divisible(model, styles, tensor_parallel_size)
        check_layers_sharded(model, styles, units, tensor_parallel_size)
        if self.float8 is not None:
            from modelpar.float8._convert import float8_layers

            float8_layers(
                model, self._float8, styles=styles, tensor_parallel_size=tensor_parallel_size, experts=self.experts
            )
        return styles, units

    @property
    def _float8(self) -> Float8Training:
        assert self.float8 is not None and not isinstance(self.float8, str)  # made a Float8Training when built
        return self.float8

    def checkpointed(self, model: nn.Module, top_units: list[str]) -> tuple[ActivationCheckpointing, list[str]]:
        """The checkpointing mode and the modules it applies to: the outermost FSDP units for a mode, else the
        outermost of the modules ``activation_checkpointing`` selects (fully recomputed)."""
        if isinstance(self.activation_checkpointing, str):
            return self.activation_checkpointing, top_units if self.activation_checkpointing != "none" else []
        return "full", outermost(resolve_units(model, self.activation_checkpointing, "activation_checkpointing"))

    def __call__(self, model: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        """Apply the plan to ``model`` on the strategy's ``device_mesh`` (2-D, or 3-D under HSDP); return it."""
        axes = device_mesh.mesh_dim_names or ()
        tp_mesh = device_mesh[_TP_AXIS] if _TP_AXIS in axes else None
        tp = tp_mesh.size() if tp_mesh is not None else 1
        cp_mesh = context_parallel_mesh(device_mesh)
        ep_mesh = expert_parallel_mesh(device_mesh)
        cp, ep = (m.size() if m is not None else 1 for m in (cp_mesh, ep_mesh))
        styles, units = self._resolve(model, tp, cp, ep)
        if self.float8 is not None:  # first: tensor parallelism and FSDP shard the float8 layers
            from modelpar.float8._convert import convert

            convert(
                model,
                self._float8,
                device_mesh=device_mesh,
                styles=styles,
                tensor_parallel_size=tp,
                experts=self.experts,
            )
        # Before activation checkpointing and compile, which must trace and recompute the replaced kernel.
        apply_context_parallel(model, device_mesh, self.attention)
        if tp_mesh is not None and tp > 1:
            for name, style in styles.items():
                apply_style(
                    model.get_submodule(name),
                    style,
                    tp_mesh,
                    sequence_parallel=self.sequence_parallel,
                    loss_parallel=self.loss_parallel,
                    consumers=[
                        model.get_submodule(n)
                        for n, s in styles.items()
                        if n.startswith(name + ".") and s in COLUMN_STYLES
                    ],
                )
        top = outermost(units)
        mode, checkpointed = self.checkpointed(model, top)
        if mode != "none":
            for index, name in enumerate(checkpointed, start=1):
                if index % self.ac_every == 0:
                    checkpoint_module(model.get_submodule(name), mode)
        if self.compile:
            for name in top:
                model.get_submodule(name).compile()
        overrides: dict[str, Any] = {}
        if self.reshard_after_forward is not None:
            overrides["reshard_after_forward"] = self.reshard_after_forward
        if self.mp_policy is not None:
            overrides["mp_policy"] = self.mp_policy
        apply_experts(model, device_mesh, self.experts, **overrides)  # experts first: FSDP goes bottom-up
        kwargs = fsdp_kwargs(device_mesh, **overrides)
        for name in sorted(units, key=lambda n: n.count("."), reverse=True):  # bottom-up; stable within a depth
            fully_shard(model.get_submodule(name), **kwargs)
        fully_shard(model, **kwargs)
        if self.float8 is not None:
            from modelpar.float8._scales import refresh_scales_before_forward

            refresh_scales_before_forward(model)  # after fully_shard: its hooks go before FSDP2's
        return model
