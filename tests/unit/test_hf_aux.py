"""``modelpar.hf.router_aux_loss`` on one process: transformers' own load-balancing loss, and the refusals.

On one process (no process group, ``device_mesh=None``) the function must give exactly what the family's
``load_balancing_loss_func`` gives and what the model put in ``outputs.aux_loss``, with and without padding, in value
and in gradient; the global-batch behaviour over several ranks is tested in tests/distributed/test_hf_router_loss.py.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3MoeConfig, SwitchTransformersConfig

from hf_tiny import TINY_SIZES
from modelpar.hf import router_aux_loss, with_global_router_loss
from modelpar.hf._aux import aux_loss_coef, moe_sizes

FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **TINY_SIZES, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12
    ),
    "mixtral": lambda: MixtralConfig(**{**TINY_SIZES, "intermediate_size": 12}, num_local_experts=4),
}


def model_of(family: str) -> Any:
    torch.manual_seed(0)
    config = FAMILIES[family]()
    config.router_aux_loss_coef = 0.5
    return AutoModelForCausalLM.from_config(config)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, TINY_SIZES["vocab_size"], (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # right padding on two rows
    mask[2, 3:] = 0
    return ids, mask


@pytest.mark.parametrize("masked", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_on_one_process_it_is_transformers_load_balancing_loss_in_value_and_gradient(family, masked):
    model = model_of(family)
    ids, mask = batch()
    mask_arg = mask if masked else None
    outputs = model(ids, attention_mask=mask_arg, labels=ids, output_router_logits=True)
    family_fn = importlib.import_module(f"transformers.models.{family}.modeling_{family}").load_balancing_loss_func
    n_experts, top_k = moe_sizes(model)
    want = family_fn(outputs.router_logits, n_experts, top_k, mask_arg)
    got = router_aux_loss(outputs.router_logits, model, device_mesh=None, attention_mask=mask_arg)
    assert torch.equal(got, want)
    assert torch.equal(got, outputs.aux_loss)
    logits = outputs.router_logits
    want_grads = torch.autograd.grad(want, logits, retain_graph=True)
    got_grads = torch.autograd.grad(got, logits, retain_graph=True)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-6)
    # the model's loss, rebuilt around the global (here: the same) aux loss
    torch.testing.assert_close(
        with_global_router_loss(outputs, model, device_mesh=None, attention_mask=mask_arg), outputs.loss
    )


def test_sizes_and_coefficient_are_read_as_each_family_names_them():
    assert moe_sizes(model_of("qwen3_moe")) == (4, 2)  # num_experts
    assert moe_sizes(FAMILIES["mixtral"]()) == (4, 2)  # num_local_experts
    assert aux_loss_coef(model_of("mixtral")) == 0.5
    deepseek = importlib.import_module("transformers").DeepseekV3Config(n_routed_experts=16, num_experts_per_tok=4)
    assert moe_sizes(deepseek) == (16, 4)  # n_routed_experts
    dbrx = importlib.import_module("transformers").DbrxConfig(ffn_config={"moe_num_experts": 8, "moe_top_k": 2})
    assert moe_sizes(dbrx) == (8, 2)  # DBRX keeps them in ffn_config


def test_a_config_without_experts_is_refused_naming_the_attributes():
    with pytest.raises(ValueError, match="none of the config attributes `num_experts`, `num_local_experts`"):
        router_aux_loss((torch.zeros(4, 4),), LlamaConfig(**TINY_SIZES), device_mesh=None)
    with pytest.raises(ValueError, match=r"number of experts per token: none of .*`num_experts_per_tok`"):
        moe_sizes(LlamaConfig(**TINY_SIZES, num_experts=4))
    with pytest.raises(ValueError, match="`num_experts_per_tok` is 0; it must be a positive int"):
        moe_sizes(LlamaConfig(**TINY_SIZES, num_experts=4, num_experts_per_tok=0))
    with pytest.raises(ValueError, match="routes each token to 5 of 4 experts"):
        moe_sizes(LlamaConfig(**TINY_SIZES, num_experts=4, num_experts_per_tok=5))
    with pytest.raises(TypeError, match="takes a Hugging Face model or its config, got dict"):
        moe_sizes({"num_experts": 4})


def test_families_with_another_aux_loss_are_refused():
    with pytest.raises(NotImplementedError, match="`switch_transformers` models compute another auxiliary loss"):
        moe_sizes(SwitchTransformersConfig(num_experts=4))


def test_missing_or_misshapen_router_logits_and_masks_are_refused_with_the_fix():
    model = model_of("qwen3_moe")
    with pytest.raises(ValueError, match="Call the model with `output_router_logits=True`"):
        router_aux_loss(None, model, device_mesh=None)
    with pytest.raises(ValueError, match=r"router_logits\[1\] has shape \(6, 3\), but the config has 4 experts"):
        router_aux_loss((torch.zeros(6, 4), torch.zeros(6, 3)), model, device_mesh=None)
    with pytest.raises(ValueError, match="attention_mask has 5 entries for 6 rows of router logits"):
        router_aux_loss((torch.zeros(6, 4),), model, device_mesh=None, attention_mask=torch.ones(5))
    ids, _ = batch()
    with pytest.raises(ValueError, match=r"`outputs.loss` is None. Call the model with `labels`"):
        with_global_router_loss(model(ids, output_router_logits=True), model, device_mesh=None)
    with pytest.raises(ValueError, match=r"`outputs.aux_loss` is None. Call the model with `output_router_logits"):
        with_global_router_loss(model(ids, labels=ids), model, device_mesh=None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bf16_and_fp32_router_logits_give_transformers_value_bitwise(dtype):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = tuple(torch.randn(21, 8, generator=g).to(dtype) for _ in range(3))
    mask = (torch.rand(3, 7, generator=g) > 0.3).long()
    config = Qwen3MoeConfig(**TINY_SIZES, num_experts=8, num_experts_per_tok=3)
    for m in (None, mask):
        want = load_balancing_loss_func(logits, 8, 3, m)
        assert torch.equal(router_aux_loss(logits, config, device_mesh=None, attention_mask=m), want)
