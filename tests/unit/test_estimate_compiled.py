"""Activations of compiled decoder layers (``ParallelPlan(compile=True)``) against what a compiled CPU step keeps.

Measured as in ``test_estimate_activations.py`` (``tests/memory_probe.py``: the bytes live when backward starts),
with every decoder layer checkpointed and then compiled, the plan's order, under ``aot_eager_decomp_partition``:
inductor's decompositions and partitioner without its code generation, so the saved tensors are inductor's and a
setting compiles in seconds. ``benchmarks/calibrate_estimate.py`` runs the wider grid under inductor itself.
"""

from __future__ import annotations

import pytest
import torch

from memory_probe import estimate_single_process, measure_single_process
from modelpar import estimate_memory
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_MOE_PLAN, LLAMA_PLAN

pytest.importorskip("transformers")

#: modelpar's Llama and Qwen3 (q / k norms, grouped-query SDPA) without checkpointing and under "selective"; fp32
#: and bf16 differ only in the bytes per element. "full" keeps the layer inputs, compiled or not (the calibration
#: script measures it).
SETTINGS = [
    ("llama", "none", torch.bfloat16),
    ("llama", "selective", torch.float32),
    ("hf-qwen3", "none", torch.bfloat16),
    ("hf-qwen3", "selective", torch.bfloat16),
]


@pytest.mark.parametrize(("kind", "checkpointing", "dtype"), SETTINGS, ids=str)
def test_compiled_activations_are_within_10_percent_of_what_the_compiled_step_keeps(kind, checkpointing, dtype):
    kwargs = {"seq_len": 128, "checkpointing": checkpointing, "dtype": dtype}
    measured = measure_single_process(kind, **kwargs, compile_backend="aot_eager_decomp_partition")
    estimated = estimate_single_process(kind, **kwargs, compile=True)
    assert abs(estimated - measured) <= 0.10 * measured, (estimated, measured)
    assert estimated < estimate_single_process(kind, **kwargs)  # compiled layers keep less than eager ones


CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)


def estimate(**plan_changes):
    with torch.device("meta"):
        model = Llama(CONFIG)
    plan = LLAMA_PLAN.replace(**plan_changes)
    return estimate_memory(model, plan=plan, data_parallel_size=1, seq_len=16, micro_batch_size=2)


def test_the_report_says_whether_activations_are_counted_as_compiled_blocks_or_eager():
    compiled, eager = estimate(compile=True), estimate()
    assert "assumes: compiled blocks (inductor" in str(compiled) and "every decoder layer" in str(compiled)
    assert "assumes: eager" in str(eager) and "compiled blocks" not in str(eager)
    assert (compiled.activations.compiled_layers, eager.activations.compiled_layers) == (4, 0)
    assert "assumes:" not in str(estimate_memory(Llama(CONFIG), plan=LLAMA_PLAN, data_parallel_size=1))


def test_only_whole_decoder_layers_count_as_compiled():
    # The plan compiles its outermost FSDP units: parts of a layer leave the layer's residual stream eager.
    parts = estimate(fsdp_units=("layers.*.attention", "layers.*.feed_forward"), compile=True)
    assert parts.activations.compiled_layers == 0 and parts.stored_activations == estimate().stored_activations
    assert "assumes: eager" in str(parts)


def test_compiled_layers_keep_the_partitioners_terms_under_each_checkpointing_mode():
    b, s, d, f, h, e, a = 2, 16, 32, 64, 4, 8, 4  # fp32; modelpar's Llama repeats K/V to every head
    rows = b * s
    none = dict(estimate(compile=True).activations.parts)["layers, not checkpointed"] // 4
    # layer input, rsqrt x 2, norm outputs x 2, attention projection's output; q, k, v (repeated), output, lse;
    # gate, up and their product
    assert none == rows * d * a * 4 + 2 * rows * 4 + rows * h * e * a * 4 + b * h * s * 4 + 3 * rows * f * a
    selective = estimate(compile=True, activation_checkpointing="selective")
    eager_selective = estimate(activation_checkpointing="selective")
    down_output = rows * d * a  # eager keeps it (a matmul), backward never reads it
    kept = "layers, selective checkpointing"
    assert dict(selective.activations.parts)[kept] == dict(eager_selective.activations.parts)[kept] - 4 * down_output
    assert selective.activations.recompute == none - dict(selective.activations.parts)[kept] // 4
    full = estimate(compile=True, activation_checkpointing="full")
    assert full.stored_activations == estimate(activation_checkpointing="full").stored_activations
    assert full.activations.recompute == none - rows * d * a
    # Checkpointing every 2nd layer: the others are compiled without checkpointing.
    every_2 = estimate(compile=True, activation_checkpointing="full", ac_every=2)
    assert dict(every_2.activations.parts)["layers, not checkpointed"] == 2 * none


def test_a_moe_model_under_checkpointing_is_counted_as_eager_with_the_reason():
    moe = LlamaConfig(**{**CONFIG.__dict__, "n_experts": 4, "top_k": 2, "moe_every": 2})
    with torch.device("meta"):
        model = Llama(moe)

    def run(**changes):
        plan = LLAMA_MOE_PLAN.replace(**changes)
        return estimate_memory(model, plan=plan, data_parallel_size=1, seq_len=16, micro_batch_size=2)

    selective = run(compile=True, activation_checkpointing="selective")
    assert selective.activations.compiled_layers == 0
    assert selective.stored_activations == run(activation_checkpointing="selective").stored_activations
    assert "routing breaks the graph inside the checkpointed region" in str(selective)
    # Without checkpointing the layers compile; the MoE feed-forwards are counted as eager.
    none, eager = run(compile=True), run()
    assert none.activations.compiled_layers == 4 and none.stored_activations < eager.stored_activations
    moe_part = "MoE feed-forwards (2 layers)"
    assert dict(none.activations.parts)[moe_part] == dict(eager.activations.parts)[moe_part]
