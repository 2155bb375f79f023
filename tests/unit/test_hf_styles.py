"""What ``modelpar.hf.plan_for`` makes of each Hugging Face tensor-parallel style: a layout, or a refusal by name.

No process group: plans are built from meta-device models of tiny configs. Training parity of the mapped
families is in ``tests/distributed/test_hf_families.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleOutput, RowwiseParallel

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from hf_tiny import TINY_SIZES
from modelpar import UnsupportedStyleError
from modelpar.hf import plan_for
from modelpar.hf._plan import HF_REFUSED, HF_STYLES
from modelpar.hf._styles import RefusedStyle, RefusedStyleError, RopeGradientSum
from modelpar.moe._routed import ExpertsOverTensorParallel

IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _meta(model_type: str, **overrides: Any) -> Any:
    config = AutoConfig.for_model(model_type, **{**TINY_SIZES, **IDS, **overrides})
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _llama_with(entries: dict[str, str]) -> Any:
    config = LlamaConfig(**TINY_SIZES)
    config.base_model_tp_plan = {**config.base_model_tp_plan, **entries}
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _is_split_input_rowwise(style: Any) -> bool:
    return isinstance(style, RowwiseParallel) and style.input_layouts == (Replicate(),)


def test_olmo2_gathers_its_attention_projections_and_its_o_proj_splits_the_replicated_input():
    plan = plan_for(_meta("olmo2"))
    styles = dict(plan.tensor_parallel)
    assert styles["model.layers.*.self_attn.q_proj"] == "colwise_gather"  # q_norm spans every head
    assert _is_split_input_rowwise(styles["model.layers.*.self_attn.o_proj"])
    assert styles["model.layers.*.mlp.down_proj"] == "rowwise"
    plan.check(_meta("olmo2"), 2)


def test_phi3_fused_projections_are_gathered_and_both_row_wise_layers_split_their_input():
    styles = dict(plan_for(_meta("phi3")).tensor_parallel)
    assert styles["model.layers.*.self_attn.qkv_proj"] == "colwise_gather"
    assert styles["model.layers.*.mlp.gate_up_proj"] == "colwise_gather"
    assert _is_split_input_rowwise(styles["model.layers.*.self_attn.o_proj"])
    assert _is_split_input_rowwise(styles["model.layers.*.mlp.down_proj"])


def test_minicpm3_kv_a_proj_sums_the_rope_gradient_and_unmatched_entries_are_left_out():
    kwargs = dict(qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, kv_lora_rank=16, q_lora_rank=16)
    styles = dict(plan_for(_meta("minicpm3", **kwargs)).tensor_parallel)
    style = styles["model.layers.*.self_attn.kv_a_proj_with_mqa"]
    assert isinstance(style, RopeGradientSum) and style.rope_dim == 4
    # With q_lora_rank the model has q_a_proj / q_b_proj and no q_proj: transformers skips that entry too.
    assert "model.layers.*.self_attn.q_proj" not in styles and styles["model.layers.*.self_attn.q_b_proj"] == "colwise"


def test_embedding_colwise_all_reduce_and_replicate_map_to_public_dtensor_styles():
    plan = plan_for(
        _llama_with({"embed_tokens": "embedding_colwise", "layers.*.mlp": "all_reduce", "norm": "replicate"})
    )
    styles = dict(plan.tensor_parallel)
    embedding = styles["model.embed_tokens"]
    assert isinstance(embedding, ColwiseParallel) and embedding.output_layouts == (Replicate(),)
    assert isinstance(styles["model.layers.*.mlp"], PrepareModuleOutput)
    assert "model.norm" not in styles  # replicated: nothing to do


@pytest.mark.parametrize(
    ("entries", "style", "reason"),
    [
        (
            {"layers.*.mlp.up_proj": "packed_colwise"},
            "packed_colwise",
            "a packed column-wise split is not supported yet: each rank must keep matching slices of every part",
        ),
        ({"layers.*.mlp.up_proj": "packed_rowwise"}, "packed_rowwise", "a packed row-wise split is not supported yet"),
        # On a module that is not an experts module (fused [num_experts, ...] weights, `num_experts`).
        ({"layers.*.mlp": "moe_tp_experts"}, "moe_tp_experts", "it splits an experts module .* `LlamaMLP`"),
        ({"layers.*.mlp": "moe_identity_expert"}, "moe_identity_expert", r"an identity \(zero-compute\) expert"),
        ({"layers.*.self_attn": "local_params"}, "local_params", "a module run on its local shards"),
    ],
)
def test_each_refused_style_is_refused_by_name_with_its_reason_under_tensor_parallelism_only(entries, style, reason):
    model = _llama_with(entries)
    plan = plan_for(model)  # the plan still serves FSDP alone
    plan.check(model, 1)
    with pytest.raises(RefusedStyleError, match=rf"to the style '{style}': {reason}") as err:
        plan.check(model, 2)
    assert isinstance(err.value, ValueError) and isinstance(err.value, NotImplementedError)
    assert "tensor_parallel_size=1" in str(err.value)


def test_a_moe_family_splits_whole_experts_over_tensor_parallelism_and_names_them_for_expert_parallelism():
    model = _meta("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    plan = plan_for(model)
    plan.check(model, 1)
    assert plan.fsdp_units == ("model.layers.*",)
    # Before: a RefusedStyle placeholder ('moe_tp_experts' refused under TP). One style for the experts module,
    # which covers its packed parameter entries; the experts modules come from the config's expert-parallel plan.
    styles = {p: s for p, s in plan.tensor_parallel.items() if "experts" in p}
    assert list(styles) == ["model.layers.*.mlp.experts"]
    assert isinstance(styles["model.layers.*.mlp.experts"], ExpertsOverTensorParallel)
    assert plan.experts == ("model.layers.*.mlp.experts",)
    plan.check(model, 2, expert_parallel_size=2)
    plan.check(model, 1, expert_parallel_size=4)
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=3 must divide .*'model\.layers\.\*\.mlp\.experts' num_experts=4"
    ):
        plan.check(model, 3)
    with pytest.raises(
        ValueError, match=r"`expert_parallel_size=3` must divide the number of experts.*among \[1, 2, 4\]"
    ):
        plan.check(model, 1, expert_parallel_size=3)


@pytest.mark.parametrize(
    "ep_plan",
    [
        {  # transformers 5.24
            "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
            "layers.*.mlp.experts.down_proj": "grouped_gemm",
            "layers.*.mlp.experts": "ep_dispatch_experts",
        },
        {  # transformers 5.17: the experts module's entry was named as the tensor-parallel style, beside a router's
            "layers.*.mlp.gate": "ep_router",
            "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
            "layers.*.mlp.experts.down_proj": "grouped_gemm",
            "layers.*.mlp.experts": "moe_tp_experts",
        },
    ],
    ids=["ep_dispatch_experts", "moe_tp_experts"],
)
def test_the_experts_modules_are_read_from_the_expert_parallel_plan_as_either_release_writes_it(ep_plan):
    model = _meta("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    model.config.base_model_ep_plan = ep_plan
    plan = plan_for(model)
    assert plan.experts == ("model.layers.*.mlp.experts",)
    plan.check(model, 1, expert_parallel_size=4)


def test_a_style_on_a_module_of_another_kind_and_a_bare_parameter_are_refused():
    with pytest.raises(UnsupportedStyleError, match=r"'model\.norm' to the style 'rowwise_split_input'.*RMSNorm"):
        plan_for(_llama_with({"norm": "rowwise_split_input"}))
    model = _llama_with({"norm.weight": "colwise"})
    plan = plan_for(model)
    assert isinstance(plan.tensor_parallel["model.norm"], RefusedStyle)
    with pytest.raises(RefusedStyleError, match=r"'model\.norm\.weight', a bare parameter, to the style 'colwise'"):
        plan.check(model, 2)


def test_mla_kv_a_proj_without_a_rope_dim_in_the_config_is_refused():
    with pytest.raises(ValueError, match=r"'mla_kv_a_proj'.*`config\.qk_rope_head_dim`.*None"):
        plan_for(_llama_with({"layers.*.self_attn.k_proj": "mla_kv_a_proj"}))


def test_the_mapped_and_refused_styles_cover_every_style_transformers_registers():
    import importlib
    import importlib.util

    if importlib.util.find_spec("transformers.distributed.expert_parallel") is not None:
        importlib.import_module("transformers.distributed.expert_parallel")  # registers the expert-parallel styles
    # (transformers 5.17 has no such module: its expert-parallel styles are registered with the others)
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    assert set(ALL_PARALLEL_STYLES) <= {*HF_STYLES, *HF_REFUSED}
    assert not set(HF_STYLES) & set(HF_REFUSED)
