"""transformers' experts modules run on their local experts the way expert and tensor parallelism call them.

One process, no mesh: the path both parallel forms share (the (token, slot) pairs sorted by expert, the module's
own forward on a view with local parameters and count, one slot of weight 1 per row, weighted and summed after)
must give the module's own output, for each experts implementation transformers 5 offers on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, GptOssConfig, MixtralConfig, Qwen3MoeConfig

from hf_tiny import TINY_SIZES
from modelpar.moe._routed import _combine, _local_runner, is_routed_experts, routed_experts_size

CONFIGS: dict[str, Any] = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **TINY_SIZES, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    ),
    "mixtral": lambda: MixtralConfig(**TINY_SIZES, num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": lambda: GptOssConfig(**TINY_SIZES, head_dim=8, num_local_experts=4, num_experts_per_tok=2),
}


def _experts(family: str, implementation: str) -> Any:
    config = CONFIGS[family]()
    config._experts_implementation = implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    experts = model.model.layers[0].mlp.experts
    for p in experts.parameters():  # some families initialize biases to zero: make every term count
        torch.nn.init.normal_(p, std=0.1)
    return experts


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm", "batched_mm"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_the_pairs_path_on_local_experts_equals_the_modules_own_forward(family, implementation):
    experts = _experts(family, implementation)
    assert is_routed_experts(experts) and routed_experts_size(experts) == 4
    tokens, k = 12, 2
    hidden = torch.randn(tokens, experts.down_proj.shape[1 if family != "gpt_oss" else 2])
    index = torch.stack([torch.randperm(4)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k).softmax(-1)
    want = experts(hidden, index, weights)

    # Experts 2 and 3 only, as the second of two ranks holds them: their pairs, by expert, local ids 0 and 1.
    run = _local_runner(experts, type(experts).forward)
    full = {name: p for name, p in experts.named_parameters(recurse=False)}
    for name, p in full.items():
        experts._parameters[name] = torch.nn.Parameter(p.detach()[2:])  # the local block, as to_local() gives it
    flat = index.flatten()
    mine = (flat >= 2).nonzero().squeeze(-1)
    pairs = mine[flat[mine].argsort(stable=True)]
    upper = _combine(hidden, pairs // k, run(hidden[pairs // k], flat[pairs] - 2, weights), weights.flatten()[pairs])
    for name, p in full.items():
        experts._parameters[name] = torch.nn.Parameter(p.detach()[:2])
    mine = (flat < 2).nonzero().squeeze(-1)
    pairs = mine[flat[mine].argsort(stable=True)]
    lower = _combine(hidden, pairs // k, run(hidden[pairs // k], flat[pairs], weights), weights.flatten()[pairs])
    torch.testing.assert_close(lower + upper, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("implementation", ["eager", "grouped_mm"])
def test_a_rank_whose_experts_get_no_pair_still_has_gradients_for_its_inputs_and_every_expert_weight(implementation):
    # Before: transformers' eager loop returned zeros depending on nothing, so this rank would skip the
    # all-to-all's backward and FSDP's reduce-scatter of its expert weights while the other ranks wait in them.
    experts = _experts("mixtral", implementation)
    run = _local_runner(experts, type(experts).forward)
    tokens = torch.randn(0, experts.down_proj.shape[1], requires_grad=True)
    out = run(tokens, torch.zeros(0, dtype=torch.long), torch.rand(3, 2))
    assert out.shape == (0, experts.down_proj.shape[1]) and out.requires_grad
    out.sum().backward()
    assert tokens.grad is not None
    assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def test_a_module_of_another_shape_is_not_taken_for_transformers_experts():
    from modelpar.models.moe import MoE

    assert not is_routed_experts(MoE(8, 16, 4, 2))  # a `dispatch` attribute: modelpar's shape
    assert not is_routed_experts(torch.nn.Linear(4, 4))
    module = torch.nn.Module()
    module.num_experts = 4
    module.w = torch.nn.Parameter(torch.zeros(3, 2))  # dim 0 is not the expert count
    assert not is_routed_experts(module)
