"""``estimate_memory`` for mixtures of experts: expert parallelism against a hand count, the search, the command line.

The tiny MoE Llama (fp32), element counts: root (embeddings 128, final norm 8, LM head 128) 264; per block: norms
16, attention 256, router [4, 8] 32, experts ``w1``, ``w3`` [4, 16, 8] and ``w2`` [4, 8, 16] 1536 (384 per expert):
1840. Activations of MoE layers against measured bytes are in ``test_estimate_activations.py``'s grid
(``llama-moe``, ``hf-qwen3-moe``, ``hf-mixtral``); the per-rank state under expert parallelism against a real
4-rank run in ``tests/distributed/test_expert_parallel.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from modelpar import MeshSizeError, estimate_memory
from modelpar._cli import main
from modelpar.memory._search import format_fits, search_layouts
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN

FIELDS = {"vocab_size": 16, "dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 16}
MOE = {**FIELDS, "n_experts": 4, "top_k": 2, "moe_hidden": 16}
EXPERT, BLOCK_WITHOUT_EXPERTS, TOTAL = 384, 304, 3944


def tiny_moe(**changes: int) -> Llama:
    with torch.device("meta"):
        return Llama(LlamaConfig(**{**MOE, "max_seq_len": 8, **changes}))


@pytest.mark.parametrize(
    ("dp", "replicate", "ep", "sharded", "unit", "gathered"),
    [
        (4, 1, 1, TOTAL // 4, "layers.0", BLOCK_WITHOUT_EXPERTS + 4 * EXPERT),  # experts inside their block's unit
        (4, 1, 2, TOTAL // 4, "layers.0.moe.experts", 2 * EXPERT),  # 2 whole experts, FSDP over 2 ranks
        (4, 1, 4, TOTAL // 4, "layers.0.moe.experts", EXPERT),  # one expert per rank, nothing to gather
        (4, 2, 2, TOTAL // 2, "layers.0.moe.experts", 2 * EXPERT),  # HSDP: shard group 2, each rank 2 experts
    ],
)
def test_expert_parallelism_keeps_the_sharded_state_and_gathers_only_the_local_experts(
    dp, replicate, ep, sharded, unit, gathered
):
    e = estimate_memory(
        tiny_moe(),
        plan=LLAMA_MOE_PLAN,
        data_parallel_size=dp,
        data_parallel_replicate_size=replicate,
        expert_parallel_size=ep,
    )
    assert (e.parameters, e.gradients, e.optimizer_states) == (4 * sharded, 4 * sharded, 8 * sharded)
    assert (e.largest_unit, e.gathered_unit, e.unit_gradients) == (unit, 4 * gathered, 4 * gathered)
    assert e.layout.expert_parallel_size == ep


def test_uneven_experts_are_padded_over_the_ranks_holding_the_same_ones():
    # 6 experts, dp 4, ep 2: 3 experts per expert rank, FSDP over 2 ranks pads them to 2 + 2 rows
    six = estimate_memory(tiny_moe(n_experts=6), plan=LLAMA_MOE_PLAN, data_parallel_size=4, expert_parallel_size=2)
    dense = 264 // 4 + 2 * (4 + 64 + 2 * 8)  # per block: norms, attention, the router's 6 rows padded to 2 + ...
    assert six.parameters == 4 * (dense + 2 * 2 * EXPERT)
    assert six.gathered_unit == 4 * 4 * EXPERT  # the padded 4 rows, as fully_shard gathers them


def test_the_all_to_all_buffers_join_the_experts_backward_under_expert_parallelism():
    kwargs = {"plan": LLAMA_MOE_PLAN, "data_parallel_size": 4, "seq_len": 4, "micro_batch_size": 2}
    ep2 = estimate_memory(tiny_moe(), expert_parallel_size=2, **kwargs)
    assert ep2.moment_name == "backward of layers.0.moe.experts"
    # dispatch or combine: send and receive 2 x 4 tokens x top-2 x dim 8, fp32 (balanced routing)
    assert dict(ep2.moment)["all-to-all send + receive"] == 2 * (2 * 4) * 2 * 8 * 4
    assert "all-to-all buffers" in str(ep2) and "balanced routing assumed" in str(ep2)
    ep1 = estimate_memory(tiny_moe(), **kwargs)
    assert "all-to-all send + receive" not in dict(ep1.moment)
    assert ep1.stored_activations == ep2.stored_activations  # balanced: a rank runs as many routed copies


def test_moe_layers_replace_the_dense_feed_forward_in_the_activations():
    # one MoE layer of two (moe_every=2): the dense layer keeps its SwiGLU, the MoE layer its own terms
    e = estimate_memory(tiny_moe(moe_every=2), plan=LLAMA_MOE_PLAN, data_parallel_size=1, seq_len=8)
    parts = dict(e.activations.parts)
    t, k, d, h, experts = 8, 2, 8, 16, 4
    router = 2 * t * experts * 4 + 2 * t * 4 + t * k * (4 + 8) + 2 * t * k * 8
    assert parts["MoE feed-forwards (1 layer)"] == router + 4 * t * k * h * 4 + 3 * t * k * d * 4 + t * k * 4


def test_bad_expert_layouts_are_refused_with_the_fix():
    with pytest.raises(MeshSizeError, match=r"`expert_parallel_size=3` must divide"):
        estimate_memory(tiny_moe(), plan=LLAMA_MOE_PLAN, data_parallel_size=4, expert_parallel_size=3)
    with pytest.raises(ValueError, match=r"must divide the number of experts, but 'layers.0.moe' has 6"):
        estimate_memory(tiny_moe(n_experts=6), plan=LLAMA_MOE_PLAN, data_parallel_size=4, expert_parallel_size=4)
    with pytest.raises(MeshSizeError, match=r"with `context_parallel_size=2` is not supported yet"):
        estimate_memory(
            tiny_moe(), plan=LLAMA_MOE_PLAN, data_parallel_size=2, context_parallel_size=2, expert_parallel_size=2
        )
    with torch.device("meta"):
        dense = Llama(LlamaConfig(**FIELDS))
    with pytest.raises(ValueError, match=r"but the plan names none"):
        estimate_memory(dense, plan=LLAMA_PLAN, data_parallel_size=4, expert_parallel_size=2)


def test_the_search_tries_every_expert_parallel_size_that_fits_and_lists_it():
    fits, tried = search_layouts(tiny_moe(), LLAMA_MOE_PLAN, world_size=4, gpu_memory=2**30, seq_len=8)
    layouts = {(f.data_parallel, f.replicate, f.context_parallel, f.tensor_parallel, f.expert_parallel) for f in fits}
    assert {(4, 1, 1, 1, 1), (4, 1, 1, 1, 2), (4, 1, 1, 1, 4), (4, 2, 1, 1, 2), (2, 1, 1, 2, 2)} <= layouts
    assert all(ep == 1 for _, _, cp, _, ep in layouts if cp > 1)  # expert parallelism refuses context parallelism
    assert not any(ep == 4 for _, replicate, _, _, ep in layouts if replicate > 1)  # 2 shard ranks per replica
    table = format_fits(fits, tried, world_size=4, gpu_memory=2**30).splitlines()
    assert table[1].split() == ["dp", "replicate", "cp", "tp", "ep", "AC", "peak", "GiB", "activations"]
    dense, _ = search_layouts(tiny_moe(), LLAMA_MOE_PLAN.replace(experts=()), world_size=4, gpu_memory=2**30, seq_len=8)
    assert {f.expert_parallel for f in dense} == {1}  # a plan that does not split experts


def test_cli_estimates_expert_parallelism_for_a_moe_llama(capsys):
    assert main(["estimate", "--llama", json.dumps(MOE), "--dp", "4", "--ep", "2", "--seq-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "experts: 2-way expert parallel (whole experts), FSDP over the 2 ranks holding the same ones" in out
    assert "layers.0.moe.experts, fp32" in out and "MoE feed-forwards (2 layers)" in out
    with pytest.raises(SystemExit):
        main(
            [
                "estimate",
                "--llama",
                json.dumps(MOE),
                "--ep",
                "2",
                "--search",
                "--seq-len",
                "8",
                "--world-size",
                "4",
                "--gpu-memory",
                "1GiB",
            ]
        )
    assert "--ep applies without --search" in capsys.readouterr().err


def test_cli_estimates_a_hugging_face_moe_config_also_with_expert_parallelism(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.Qwen3MoeConfig(
        hidden_size=8,
        intermediate_size=16,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=4,
        vocab_size=16,
    ).save_pretrained(tmp_path)
    assert main(["estimate", "--hf", str(tmp_path), "--dp", "4", "--seq-len", "8", "--precision", "bf16-mixed"]) == 0
    out = capsys.readouterr().out
    assert "MoE feed-forwards (2 layers)" in out and "4 experts, top-2" in out
    # Before: refused ("expert parallelism is built for `modelpar.models.moe.MoE` only").
    assert main(["estimate", "--hf", str(tmp_path), "--dp", "4", "--ep", "2"]) == 0
    assert "2-way expert parallel" in capsys.readouterr().out
