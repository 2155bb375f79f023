"""What each Hugging Face tensor-parallel style becomes in modelpar: a DTensor layout, or a refusal with its reason.

``transformers`` registers its styles in ``transformers.distributed.tensor_parallel`` (``ALL_PARALLEL_STYLES``);
a config's ``base_model_tp_plan`` and a model class's ``_tp_plan`` name them per submodule or parameter.
:func:`translate` maps one entry onto a :class:`~modelpar.plans.ParallelPlan` style: a named style where one
fits, else a ``ParallelStyle`` built from torch's public ``torch.distributed.tensor(.parallel)`` APIs. The styles
that cannot be expressed that way (yet) are refused by name, with the reason, in :data:`HF_REFUSED`.
``scripts/hf_tp_styles.py`` counts which configs use which style and prints these outcomes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from modelpar.plans._styles import StyleSpec

__all__ = ["HF_REFUSED", "HF_STYLES", "RefusedStyle", "RefusedStyleError", "SKIP", "translate"]

#: Hugging Face style -> what :func:`translate` makes of it (see ``docs/huggingface.md``).
HF_STYLES: Mapping[str, str] = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather ('output' on the LM head)",
    "colwise_rep": "colwise_gather ('output' on the LM head)",
    "embedding_rowwise": "embedding",
    "embedding_colwise": "ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()) on the nn.Embedding",
    "sequence_parallel": "norm",
    "replicated_with_grad_allreduce": "replicated, gradient summed over the tensor-parallel ranks",
    "rowwise_split_input": "RowwiseParallel(input_layouts=Replicate()): the replicated input is split locally",
    "rowwise_rep": "RowwiseParallel(input_layouts=Replicate()): the replicated input is split locally",
    "mla_kv_a_proj": "replicated; the gradient of the output's rope part is summed over the tensor-parallel ranks",
    "all_reduce": "PrepareModuleOutput(Partial() -> Replicate()): the partial output is summed",
    "replicate": "replicated (the entry is left out)",
    "moe_tp_experts": (
        "whole experts per tensor-parallel rank (Shard(0) on the expert dim), the outputs summed by one all-reduce;"
        " its 'packed_colwise' / 'rowwise' parameter entries are covered by it"
    ),
}

_PACKED = (
    "each rank must keep matching slices of every part of a packed tensor (fused gate/up: the same rows of the"
    " gate and of the up projection), a layout DTensor expresses only with torch's private `_StridedShard`"
    " placement"
)
_EXPERTS_FIX = (
    "Use `tensor_parallel_size=1` (FSDP shards the fused `[experts, ...]` tensors like any weight), or write a"
    " `modelpar.plans.ParallelPlan` that splits only the attention and dense projections"
)

_EXPERT_PARALLEL_STYLE = (
    "an expert-parallel style (an entry of transformers' `base_model_ep_plan`, from which `plan_for` takes the"
    " experts modules as the plan's `experts`) is not a tensor-parallel layout. Use `expert_parallel_size` for"
    " expert parallelism, and the model's `base_model_tp_plan` (or `tensor_parallel_size=1`) for tensor parallelism"
)

#: Hugging Face style -> why modelpar refuses it (a :class:`RefusedStyleError` naming the style).
HF_REFUSED: Mapping[str, str] = {
    "packed_colwise": f"a packed column-wise split is not supported yet: {_PACKED}. {_EXPERTS_FIX}",
    "packed_rowwise": f"a packed row-wise split is not supported yet: {_PACKED}. {_EXPERTS_FIX}",
    "moe_identity_expert": (
        "an identity (zero-compute) expert beside tensor-parallel experts is not supported yet: its tokens would be"
        f" counted once per tensor-parallel rank in the summed output. {_EXPERTS_FIX}"
    ),
    "grouped_gemm": _EXPERT_PARALLEL_STYLE,
    "ep_dispatch_experts": _EXPERT_PARALLEL_STYLE,
    "ep_router": _EXPERT_PARALLEL_STYLE,  # transformers 5.17's router entry of `base_model_ep_plan`
    # transformers 5.17 registers these for its FP8 x FP4 DeepGEMM "Mega MoE" kernels (quantized experts, SM100+).
    "megamoe_experts": (
        "an expert-parallel style of transformers' FP8 x FP4 DeepGEMM kernels for quantized experts (5.17), not a"
        " tensor-parallel layout: quantized experts are not supported. Use `tensor_parallel_size=1` with a model"
        " whose experts are in bf16 or fp32"
    ),
    "megamoe_router": (
        "an expert-parallel style of transformers' FP8 x FP4 DeepGEMM kernels for quantized experts (5.17), not a"
        " tensor-parallel layout: quantized experts are not supported. Use `tensor_parallel_size=1` with a model"
        " whose experts are in bf16 or fp32"
    ),
    "local_params": (
        "a module run on its local shards (`local_params`, with a bare parameter such as attention sinks split"
        " per head) is not supported yet: its DTensor parameters would meet the attention kernel's plain"
        " tensors. Use `tensor_parallel_size=1`, or write a `modelpar.plans.ParallelPlan` that leaves that"
        " attention replicated"
    ),
}

#: :func:`translate`'s answer for an entry that needs no sharding (the parameter stays replicated).
SKIP = "skip"


class RefusedStyleError(ValueError, NotImplementedError):
    """A Hugging Face tensor-parallel style that modelpar knows and cannot express yet.

    A ``ValueError`` as an unknown style is (so existing ``except`` clauses keep working), and a
    ``NotImplementedError`` since the refusal is of a feature, not of a wrong input.
    """


class RefusedStyle(ParallelStyle):
    """A plan entry modelpar cannot split: harmless without tensor parallelism, refused with its reason with it.

    ``plan_for`` keeps a refused style's module in the plan as this placeholder, so that the same plan serves
    FSDP alone (``tensor_parallel_size=1``: no style is applied, the fused ``[experts, ...]`` tensors are sharded
    like any weight); with ``tensor_parallel_size > 1`` the plan's check raises :attr:`refusal` (read by
    ``modelpar.plans`` as the attribute ``refusal``) before anything is sharded.
    """

    def __init__(self, refusal: RefusedStyleError) -> None:
        super().__init__()
        self.refusal = refusal

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        raise self.refusal


def refused(pattern: str, hf_style: str) -> RefusedStyleError:
    return RefusedStyleError(
        f"The Hugging Face tensor-parallel plan maps {pattern!r} to the style {hf_style!r}: {HF_REFUSED[hf_style]}."
    )


def translate(pattern: str, hf_style: Any, module: nn.Module | None, *, on_head: bool, config: Any) -> StyleSpec:
    """The :class:`~modelpar.plans.ParallelPlan` style for one Hugging Face plan entry, or :data:`SKIP`.

    ``module`` is the submodule the pattern names (the first match), ``None`` for a bare parameter.
    """
    if hf_style in HF_REFUSED:
        raise refused(pattern, hf_style)
    if hf_style == "replicate":
        return SKIP
    if hf_style == "moe_tp_experts" and module is not None:
        from modelpar.moe._routed import ExpertsOverTensorParallel, is_routed_experts

        if is_routed_experts(module):
            return ExpertsOverTensorParallel()
        raise RefusedStyleError(
            f"The Hugging Face tensor-parallel plan maps {pattern!r} to the style 'moe_tp_experts': it splits an"
            " experts module with fused [num_experts, ...] parameters and a `num_experts` attribute, but it is"
            f" `{type(module).__name__}`. {_EXPERTS_FIX}."
        )
    if module is None:
        raise RefusedStyleError(
            f"The Hugging Face tensor-parallel plan maps {pattern!r}, a bare parameter, to the style {hf_style!r}:"
            " splitting a parameter outside a module's own style is not supported. Write a"
            " `modelpar.plans.ParallelPlan` for this model, starting from `plan_for`'s other entries."
        )
    if hf_style in ("colwise", "rowwise"):
        return str(hf_style)
    if hf_style in ("colwise_gather_output", "colwise_rep"):
        return "output" if on_head else "colwise_gather"
    if hf_style == "embedding_rowwise":
        return "embedding"
    if hf_style == "sequence_parallel":
        return "norm"
    if hf_style == "replicated_with_grad_allreduce":
        # The module (a per-head norm between column- and row-parallel projections) sees this rank's heads only.
        # Its parameters become replicated DTensors and its input is declared split on the heads dim (-2), so
        # DTensor sums the ranks' partial gradients; the output goes back to a local tensor.
        return SequenceParallel(sequence_dim=-2, use_local_output=True)
    if hf_style in ("rowwise_split_input", "rowwise_rep"):
        # The input arrives whole on every rank (after a gathered projection): each rank takes its slice of the
        # last dim (no communication forward, an all-gather of the input gradient backward), as transformers does.
        _expect(pattern, hf_style, module, nn.Linear)
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if hf_style == "embedding_colwise":
        _expect(pattern, hf_style, module, nn.Embedding)
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if hf_style == "all_reduce":
        return PrepareModuleOutput(output_layouts=Partial(), desired_output_layouts=Replicate())
    if hf_style == "mla_kv_a_proj":
        _expect(pattern, hf_style, module, nn.Linear)
        return RopeGradientSum(_rope_dim(pattern, config))
    raise ValueError(
        f"The Hugging Face tensor-parallel plan maps {pattern!r} to the style {hf_style!r}, which modelpar does not"
        f" translate. Supported styles: {list(HF_STYLES)}. Write a `modelpar.plans.ParallelPlan` for this model,"
        " or take `plan_for(model).tensor_parallel` as a start and replace that entry."
    )


def _expect(pattern: str, hf_style: str, module: nn.Module, kind: type[nn.Module]) -> None:
    if not isinstance(module, kind):
        from modelpar import UnsupportedStyleError

        raise UnsupportedStyleError(
            f"The Hugging Face tensor-parallel plan maps {pattern!r} to the style {hf_style!r}, which shards"
            f" nn.{kind.__name__} modules, but it is `{type(module).__name__}`. Write a `modelpar.plans.ParallelPlan`"
            " for this model, starting from `plan_for`'s other entries."
        )


def _rope_dim(pattern: str, config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope_dim = getattr(text, "qk_rope_head_dim", None)
    if not isinstance(rope_dim, int) or rope_dim <= 0:
        raise ValueError(
            f"The Hugging Face tensor-parallel plan maps {pattern!r} to 'mla_kv_a_proj', which splits the"
            f" projection's output into its latent and rope parts by `config.qk_rope_head_dim`, but the config has"
            f" {rope_dim!r}. Set `qk_rope_head_dim` in the config."
        )
    return rope_dim


class RopeGradientSum(ParallelStyle):
    """MLA's ``kv_a_proj_with_mqa`` (DeepSeek-V2, MiniCPM3 ...): replicated, with the rope part's gradient summed.

    Its output is ``[latent | rope]``. The latent feeds the column-parallel ``kv_b_proj``, whose style already
    sums the input gradient over the tensor-parallel ranks; the last ``rope_dim`` features go straight to
    attention as the key shared by all heads, of which each rank holds only its own, so that part's gradient
    is partial on each rank. The forward is unchanged; backward, the rope part's gradient is summed (a
    replicated DTensor whose local gradient is declared ``Partial``).
    """

    replicates_parameters = True  # read by the memory estimate: the weight is counted whole on every rank

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rope_dim = self.rope_dim

        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            latent, rope = output.split([output.shape[-1] - rope_dim, rope_dim], dim=-1)
            rope = DTensor.from_local(rope, device_mesh, [Replicate()], run_check=False)
            return torch.cat([latent, rope.to_local(grad_placements=[Partial()])], dim=-1)

        module.register_forward_hook(hook)
        return module
