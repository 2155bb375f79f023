"""Activations, FSDP2 transients and the peak of ``estimate_memory``, against what a CPU step measures.

Measured: the bytes a forward and the loss allocate and still hold when backward starts (the CPU profiler's
memory events, which see inside activation checkpointing; ``tests/memory_probe.py``). Without checkpointing
that is what autograd saves for backward plus the logits the step holds, which the second test checks with
``saved_tensors_hooks``. Tensor-parallel settings are measured in ``tests/distributed/test_estimate.py``.
"""

from __future__ import annotations

import pytest
import torch

from memory_probe import (
    CALIBRATION_MODELS,
    calibration_model,
    estimate_single_process,
    measure_single_process,
    saved_for_backward,
)
from modelpar import estimate_memory
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_PLAN

pytest.importorskip("transformers")

SETTINGS = [
    (kind, seq, ac, torch.float32)
    for kind in CALIBRATION_MODELS
    for seq in (128, 256)
    for ac in ("none", "full", "selective")
] + [(kind, 128, ac, torch.bfloat16) for kind in CALIBRATION_MODELS for ac in ("none", "selective")]


@pytest.mark.parametrize(("kind", "seq_len", "checkpointing", "dtype"), SETTINGS, ids=str)
def test_estimated_activations_are_within_10_percent_of_the_measured(kind, seq_len, checkpointing, dtype):
    measured = measure_single_process(kind, seq_len=seq_len, checkpointing=checkpointing, dtype=dtype)
    estimated = estimate_single_process(kind, seq_len=seq_len, checkpointing=checkpointing, dtype=dtype)
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)


def test_without_checkpointing_what_is_live_is_what_autograd_saves_plus_the_logits():
    import torch.nn.functional as F

    model = calibration_model("llama", 128)
    tokens = torch.randint(0, 256, (2, 128))

    def step():
        logits = model(tokens)
        return logits, F.cross_entropy(logits.reshape(-1, 256), tokens.reshape(-1))

    saved, (logits, _) = saved_for_backward(model, step)
    live = measure_single_process("llama", seq_len=128, checkpointing="none", dtype=torch.float32)
    # The step holds the logits and the loss beyond what autograd saves; the token ids, saved by the embedding,
    # were allocated before the step (the estimate counts them: the batch is alive during the step).
    assert live - (saved - tokens.numel() * 8) == logits.numel() * 4 + 4


TINY = LlamaConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=16, max_seq_len=32)
ROOT, BLOCK = 264, 656  # elements: embeddings + final norm + LM head; one block
BUFFERS = 2 * 32 * 2 * 4  # RoPE cos and sin, [max_seq_len, head_dim / 2] fp32


def tiny() -> Llama:
    with torch.device("meta"):
        return Llama(TINY)


def test_without_seq_len_the_old_figures_stay_and_the_peak_adds_fsdp2_transients():
    e = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=2)
    assert e.total == 16 * 788 + 8 * BLOCK + BUFFERS and e.activations is None
    assert e.root_gathered == 4 * ROOT  # the root stays gathered from forward through backward
    # Worst moment: a block's backward: gathered, unsharded gradients, reduce-scatter input (all fp32 here).
    assert e.moment_name == "backward of layers.0" and sum(size for _, size in e.moment) == 3 * 4 * BLOCK
    assert e.peak == 16 * 788 + BUFFERS + 4 * ROOT + 12 * BLOCK
    assert "activations" in str(e) and "not counted: pass seq_len" in str(e)


def test_bf16_mixed_reduce_scatter_input_is_fp32_beside_bf16_unsharded_gradients():
    e = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=2, precision="bf16-mixed")
    assert dict(e.moment) == {
        "unit gathered": 2 * BLOCK,
        "unsharded gradients": 2 * BLOCK,
        "reduce-scatter input": 4 * BLOCK,
        "recomputed activations": 0,
    }


def test_reshard_after_forward_false_keeps_every_unit_gathered():
    e = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=2, reshard_after_forward=False)
    assert e.root_gathered == 4 * (ROOT + 2 * BLOCK)
    assert dict(e.moment)["unit gathered"] == 0  # already counted in the gathered set
    plan = LLAMA_PLAN.replace(reshard_after_forward=False)  # the plan's option wins, as when it runs
    assert estimate_memory(tiny(), plan=plan, data_parallel_size=2).root_gathered == e.root_gathered


def test_full_checkpointing_keeps_one_input_per_layer_and_recomputes_one_layer_in_backward():
    plan = LLAMA_PLAN.replace(activation_checkpointing="full")
    e = estimate_memory(tiny(), plan=plan, data_parallel_size=1, seq_len=32, micro_batch_size=2)
    parts = dict(e.activations.parts)
    assert parts["layers, full checkpointing"] == 2 * (2 * 32 * 8 * 4)
    none = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=32, micro_batch_size=2)
    per_layer = dict(none.activations.parts)["layers, not checkpointed"] // 2
    assert e.activations.recompute == per_layer - 2 * 32 * 8 * 4
    every_2 = estimate_memory(tiny(), plan=plan.replace(ac_every=2), data_parallel_size=1, seq_len=32)
    assert dict(every_2.activations.parts)["layers, full checkpointing"] == 32 * 8 * 4
    assert e.peak == e.peak  # defined
    assert "b 2 x seq 32, fp32, AC full" in str(e)


def test_context_parallel_keeps_local_tokens_and_the_gathered_keys_and_values():
    one = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=32)
    two = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=32, context_parallel_size=2)
    assert dict(two.activations.parts)["logits"] == dict(one.activations.parts)["logits"] // 2
    assert dict(two.activations.parts)["cp gathered K/V"] == 2 * (2 * 32 * 2 * 4 * 4)  # layers x 2 b S g e a
    # FSDP shards over the data-parallel x context-parallel ranks.
    assert two.parameters == estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=2).parameters


def test_tensor_and_loss_parallel_split_the_logits():
    plan = LLAMA_PLAN.replace(loss_parallel=True, sequence_parallel=True)
    tp = estimate_memory(tiny(), plan=plan, data_parallel_size=1, tensor_parallel_size=2, seq_len=32)
    full = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, tensor_parallel_size=2, seq_len=32)
    assert dict(tp.activations.parts)["logits"] == 32 * 8 * 4 and dict(full.activations.parts)["logits"] == 32 * 16 * 4
    assert "SP, LP" in str(tp)


def test_bad_activation_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"estimate_memory\(seq_len=0\) must be a positive int"):
        estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=0)
    with pytest.raises(
        ValueError,
        match=r"seq_len=33\) must divide by 2 x context_parallel_size=2 \(two load-balanced chunks per rank\) = 4",
    ):
        estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=33, context_parallel_size=2)
    plain = torch.nn.Linear(4, 4, device="meta")
    from modelpar.plans import ParallelPlan

    with pytest.raises(ValueError, match=r"counts activations of Llama-style decoders.*Leave `seq_len=None`"):
        estimate_memory(plain, plan=ParallelPlan(), data_parallel_size=1, seq_len=8)


def _parts(e) -> int:
    """The peak's parts as the table lists them, without the gradients."""
    return (
        e.parameters
        + e.optimizer_states
        + e.buffers
        + e.root_gathered
        + e.stored_activations
        + sum(size for _, size in e.moment)
    )


def test_one_micro_batch_per_step_counts_the_gradients_only_beyond_the_activations():
    # zero_grad(set_to_none=True) freed them; backward writes them while it frees the activations.
    e = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=32, micro_batch_size=2)
    assert e.gradients < e.stored_activations  # this setting: the activations are the larger
    assert e.peak_gradients == 0 and e.peak == _parts(e)
    assert e.total == e.parameters + e.gradients + e.optimizer_states + e.gathered_unit + e.unit_gradients + e.buffers
    short = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=1)
    assert short.gradients > short.stored_activations  # one token: the gradients are the larger
    assert short.peak == _parts(short) + short.gradients - short.stored_activations


def test_accumulation_holds_the_gradients_beside_every_activation():
    one = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=32, micro_batch_size=2)
    four = estimate_memory(
        tiny(), plan=LLAMA_PLAN, data_parallel_size=1, seq_len=32, micro_batch_size=2, accumulate_grad_batches=4
    )
    assert four.peak_gradients == four.gradients and four.peak == one.peak + one.gradients
    assert "gradients                         kept over 4 micro-batches" in str(four)
    assert "beyond the activations backward frees" in str(one)


def test_without_seq_len_the_gradients_count_whole_as_before():
    e = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=2)
    assert e.peak_gradients == e.gradients and e.peak == 16 * 788 + BUFFERS + 4 * ROOT + 12 * BLOCK


def test_offloaded_gradients_are_not_on_the_device_at_the_peak():
    e = estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=2, cpu_offload=True, accumulate_grad_batches=2)
    assert e.host == e.parameters + e.gradients + e.optimizer_states
    assert e.peak_gradients == 0 and e.peak == e.buffers + e.root_gathered + sum(size for _, size in e.moment)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError)])
def test_accumulate_grad_batches_must_be_a_positive_int(value, error):
    with pytest.raises(error, match=rf"`accumulate_grad_batches={value!r}` must be"):
        estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=1, accumulate_grad_batches=value)
