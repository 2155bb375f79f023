"""Context parallelism without a process group: the load-balanced layout, batch completion, the cp=1 kernel,
and the refusals (types and messages)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import modelpar.context
from modelpar.context import (
    ContextParallelAttention,
    context_parallel_attention,
    load_balanced_positions,
    shard_batch,
    shift_labels_for_causal_lm,
    use_context_parallel_attention,
)


def test_public_surface_is_what_we_mean() -> None:
    assert sorted(modelpar.context.__all__) == [
        "ContextParallelAttention",
        "context_parallel_attention",
        "cross_entropy",
        "load_balanced_positions",
        "shard_batch",
        "shard_sequence",
        "shift_labels_for_causal_lm",
        "unshard_sequence",
        "use_context_parallel_attention",
    ]


def test_rank_i_holds_chunks_i_and_2cp_minus_1_minus_i() -> None:
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert load_balanced_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert load_balanced_positions(6, 1, 0).tolist() == list(range(6))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_the_shards_of_every_rank_cover_the_sequence_once_with_balanced_causal_work(cp: int) -> None:
    seq = 8 * cp
    positions = [load_balanced_positions(seq, cp, r) for r in range(cp)]
    assert sorted(torch.cat(positions).tolist()) == list(range(seq))
    # The keys a rank's queries attend to, summed: the same on every rank.
    work = {int((p + 1).sum()) for p in positions}
    assert len(work) == 1


def test_sharding_by_positions_and_gathering_in_rank_order_round_trips() -> None:
    cp, seq = 3, 12
    x = torch.randn(2, seq, 5)
    shards = [x[:, load_balanced_positions(seq, cp, r)] for r in range(cp)]
    gathered = torch.cat(shards, dim=1)
    order = torch.cat([load_balanced_positions(seq, cp, r) for r in range(cp)]).argsort()
    torch.testing.assert_close(gathered[:, order], x)


def test_positions_refuse_lengths_that_do_not_cut_into_2cp_chunks() -> None:
    with pytest.raises(ValueError, match=r"has length 10, but .* over 2 ranks .* 4 equal chunks.*\(e\.g\. 12"):
        load_balanced_positions(10, 2, 0)
    with pytest.raises(ValueError, match=r"`cp_rank=2` is not a rank of a context-parallel group of 2"):
        load_balanced_positions(8, 2, 2)


def test_shift_labels_predicts_the_next_token_and_ignores_padding_and_the_last_position() -> None:
    labels = torch.tensor([[5, 6, 7, 8, 9], [1, 2, 3, 4, 0]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert shift_labels_for_causal_lm(labels).tolist() == [[6, 7, 8, 9, -100], [2, 3, 4, 0, -100]]
    assert shift_labels_for_causal_lm(labels, mask, ignore_index=-1).tolist() == [
        [-1, 7, 8, 9, -1],
        [2, 3, -1, -1, -1],
    ]


def test_shard_batch_without_context_parallelism_completes_the_batch() -> None:
    ids = torch.arange(12).view(2, 6)
    mask = torch.ones(2, 6, dtype=torch.long)
    out = shard_batch({"input_ids": ids, "attention_mask": mask, "meta": "kept"}, None, shift_labels=True)
    assert out["position_ids"].tolist() == [list(range(6))] * 2
    assert out["labels"][0].tolist() == [1, 2, 3, 4, 5, -100]
    assert out["attention_mask"].dtype == torch.bool
    assert out["meta"] == "kept"
    assert out["input_ids"] is ids


def test_shard_batch_refuses_masks_it_cannot_honour() -> None:
    ids = torch.zeros(2, 6, dtype=torch.long)
    with pytest.raises(ValueError, match=r"`attention_mask` is \(2, 1, 6, 6\), but .* 2-D padding mask \(batch, 6\)"):
        shard_batch({"input_ids": ids, "attention_mask": torch.ones(2, 1, 6, 6)}, None)
    with pytest.raises(ValueError, match="values other than 0 and 1"):
        shard_batch({"input_ids": ids, "attention_mask": torch.full((2, 6), 2)}, None)
    with pytest.raises(ValueError, match=r"keys \['x'\], but .* Add `input_ids`"):
        shard_batch({"x": 1}, None)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_without_context_parallelism_the_kernel_is_causal_sdpa(kv_heads: int) -> None:
    q, k, v = torch.randn(2, 4, 7, 8), torch.randn(2, kv_heads, 7, 8), torch.randn(2, kv_heads, 7, 8)
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(4 // kv_heads, 1), v.repeat_interleave(4 // kv_heads, 1), is_causal=True, scale=0.3
    )
    torch.testing.assert_close(context_parallel_attention(q, k, v, None, scale=0.3), expected)


def test_kv_heads_are_shared_inside_sdpa_except_with_a_mask_on_cuda() -> None:
    from modelpar.context._attention import share_kv_heads_in_sdpa

    assert share_kv_heads_in_sdpa("cpu", masked=True)
    assert share_kv_heads_in_sdpa("cuda", masked=False)
    assert not share_kv_heads_in_sdpa("cuda", masked=True)  # the memory-efficient kernel, not math


def test_the_kernel_is_the_same_under_a_dispatch_mode_where_the_causal_bias_cannot_exist() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            return func(*args, **(kwargs or {}))

    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    from modelpar.context._attention import _chunk_attention

    expected = _chunk_attention(q, k, v, None, None)
    with Passthrough():
        torch.testing.assert_close(_chunk_attention(q, k, v, None, None), expected)


def test_left_padding_gives_zeros_not_nan_in_output_and_gradient() -> None:
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    mask = torch.tensor([[False, False, True, True]])
    out = context_parallel_attention(q, k, v, None, key_padding_mask=mask)
    out.sum().backward()
    assert out[0, :, :2].eq(0).all()
    assert not any(t.grad.isnan().any() for t in (q, k, v))  # type: ignore[union-attr]


def test_kernel_refuses_bad_shapes() -> None:
    q = torch.randn(1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"`query` has shape \(4, 4, 8\), but .* \(batch, heads, seq_local"):
        context_parallel_attention(q[0], q[0], q[0], None)
    with pytest.raises(ValueError, match="4 query heads cannot share 3 key/value heads"):
        context_parallel_attention(q, q[:, :3], q[:, :3], None)
    with pytest.raises(ValueError, match=r"must share batch, local sequence length and head_dim"):
        context_parallel_attention(q, q[:, :, :2], q[:, :, :2], None)


def test_kernel_class_refuses_a_mesh_without_the_context_axis() -> None:
    class FakeMesh:
        mesh_dim_names = ("data_parallel", "tensor_parallel")

    with pytest.raises(ValueError, match=r"axes \['data_parallel', 'tensor_parallel'\], but .* \"context_parallel\""):
        ContextParallelAttention(FakeMesh())  # type: ignore[arg-type]


def test_hf_adapter_refuses_models_whose_attention_cannot_be_replaced() -> None:
    transformers = pytest.importorskip("transformers")
    from hf_tiny import TINY_SIZES

    with pytest.raises(NotImplementedError, match="Linear is not a transformers model"):
        use_context_parallel_attention(nn.Linear(2, 2), None)  # type: ignore[arg-type]
    sliding = transformers.Qwen3Config(
        head_dim=8, use_sliding_window=True, sliding_window=8, max_window_layers=1, **TINY_SIZES
    )
    llama = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY_SIZES))
    llama._supports_attention_backend = False
    with pytest.raises(NotImplementedError, match=r"does not dispatch attention through transformers' attention"):
        use_context_parallel_attention(llama, None)  # type: ignore[arg-type]
    llama._supports_attention_backend = True
    llama.config.attn_logit_softcapping = 30.0
    with pytest.raises(NotImplementedError, match=r"soft-caps its attention logits \(`attn_logit_softcapping=30.0`\)"):
        use_context_parallel_attention(llama, None)  # type: ignore[arg-type]
    llama.config.attn_logit_softcapping = None
    llama.config.is_causal = False
    with pytest.raises(NotImplementedError, match="has non-causal attention"):
        use_context_parallel_attention(llama, None)  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"layers of types \['full_attention', 'sliding_attention'\]"):
        use_context_parallel_attention(transformers.AutoModelForCausalLM.from_config(sliding), None)  # type: ignore[arg-type]


def test_hf_attention_without_the_kernel_hook_is_refused() -> None:
    from modelpar.context._hf import _hf_attention

    q = torch.randn(1, 4, 4, 8)
    module = nn.Module()
    with pytest.raises(
        NotImplementedError, match=r"Module runs the 'modelpar_context_parallel' .* no context-parallel"
    ):
        _hf_attention(module, q, q, q, None)
