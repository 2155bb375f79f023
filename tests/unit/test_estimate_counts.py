"""``estimate_memory`` on a tiny Llama, against bytes counted by hand; the ``modelpar estimate`` command line.

The tiny model (fp32 unless said otherwise), element counts per parameter, full / tensor-parallel 2:

====================== ============ =========================
tok_embeddings [16, 8]  128          64 (vocab rows split)
per block               656          336
  norms 2 x [8]         16           16 (replicated)
  wq, wk, wv [8, 8]     192          96 (rows split)
  wo [8, 8]             64           32 (columns split)
  w1, w3 [16, 8]        256          128 (rows split)
  w2 [8, 16]            128          64 (columns split)
norm [8]                8            8
output [16, 8]          128          64
total                   1576         808
====================== ============ =========================

Buffers: RoPE cos and sin, 2 x [4, 2] fp32 = 64 bytes. Every dim 0 is even, so 2-way FSDP halves each
tensor exactly; 3-way pads (see the test).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from modelpar import MemoryEstimate, MeshSizeError, estimate_memory
from modelpar._cli import main
from modelpar.models import Llama, LlamaConfig
from modelpar.plans import LLAMA_PLAN, ParallelPlan, parallelize_llama

TINY = LlamaConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, n_kv_heads=2, ffn_hidden=16, max_seq_len=4)
BUFFERS = 64


def tiny(cfg: LlamaConfig = TINY) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


def estimate(dp: int = 1, tp: int = 1, **kwargs) -> MemoryEstimate:
    return estimate_memory(tiny(), plan=LLAMA_PLAN, data_parallel_size=dp, tensor_parallel_size=tp, **kwargs)


def state(e: MemoryEstimate) -> tuple[int, int, int, int, int]:
    return e.parameters, e.gradients, e.optimizer_states, e.gathered_unit, e.unit_gradients


# (dp, tp) -> (sharded elements per rank, elements of the largest unit gathered: a block at its TP size)
LAYOUTS = {(1, 1): (1576, 656), (2, 1): (788, 656), (1, 2): (808, 336), (2, 2): (404, 336)}


@pytest.mark.parametrize(("dp", "tp"), list(LAYOUTS))
def test_fp32_adamw_bytes_equal_the_hand_count(dp, tp):
    sharded, unit = LAYOUTS[dp, tp]
    e = estimate(dp, tp)
    assert state(e) == (4 * sharded, 4 * sharded, 8 * sharded, 4 * unit, 4 * unit)
    assert e.buffers == BUFFERS
    assert e.total == e.device == 16 * sharded + 8 * unit + BUFFERS
    assert e.host == 0
    assert e.largest_unit == "layers.0"


def test_uneven_shards_are_padded_as_fsdp2_pads_them():
    # 3-way: each dim 0 of n rows becomes ceil(n / 3) rows on every rank: 16 -> 6, 8 -> 3.
    # tok_embeddings and output 6 x 8 each, norm 3, per block 3 + 4 x 3 x 8 + 3 + 2 x 6 x 8 + 3 x 16 = 246.
    sharded = 2 * 48 + 3 + 2 * 246
    e = estimate(3, 1)
    assert e.parameters == 4 * sharded
    assert e.gathered_unit == 4 * 3 * 246  # the all-gather output is padded too: 738 elements, not 656


def test_hsdp_shards_over_the_shard_group_only():
    hsdp = estimate(4, 1, data_parallel_replicate_size=2)
    assert state(hsdp) == state(estimate(2, 1))
    assert state(estimate(4, 2, data_parallel_replicate_size=2)) == state(estimate(2, 2))
    assert "4 data-parallel (shard group 2, 2 replicas)" in str(hsdp)


def test_bf16_mixed_gathers_the_unit_in_bf16_and_keeps_fp32_state():
    e = estimate(2, 1, precision="bf16-mixed")
    assert state(e) == (4 * 788, 4 * 788, 8 * 788, 2 * 656, 2 * 656)
    assert (e.param_dtype, e.compute_dtype) == (torch.float32, torch.bfloat16)
    # The strategy's argument and the plan's own policy do the same; the plan's wins, as when it runs.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert state(estimate(2, 1, mixed_precision=policy)) == state(e)
    plan = LLAMA_PLAN.replace(mp_policy=MixedPrecisionPolicy())
    fp32 = estimate_memory(tiny(), plan=plan, data_parallel_size=2, precision="bf16-mixed")
    assert fp32.gathered_unit == 4 * 656


def test_bf16_true_stores_parameters_gradients_and_adam_states_in_bf16():
    e = estimate(2, 1, precision="bf16-true")
    assert state(e) == (2 * 788, 2 * 788, 4 * 788, 2 * 656, 2 * 656)
    assert e.buffers == BUFFERS // 2


def test_unsharded_accumulation_keeps_the_model_gradients_at_the_tensor_parallel_size():
    e = estimate(2, 2, gradient_accumulation="unsharded")
    assert (e.gradients, e.unit_gradients) == (4 * 808, 0)
    # Under bf16-mixed FSDP2 accumulates them in the reduce dtype (fp32).
    assert estimate(2, 1, gradient_accumulation="unsharded", precision="bf16-mixed").gradients == 4 * 1576


@pytest.mark.parametrize(("optimizer", "states"), [("adam", 2), ("sgd-momentum", 1), ("sgd", 0), (3, 3)])
def test_optimizer_states_count_parameter_shaped_tensors(optimizer, states):
    assert estimate(2, 1, optimizer=optimizer).optimizer_states == states * 4 * 788


def test_cpu_offload_moves_the_sharded_state_to_the_host():
    e = estimate(2, 1, cpu_offload=True)
    assert e.host == 16 * 788
    assert e.device == 8 * 656 + BUFFERS
    table = str(e)
    assert "host" in table.splitlines()[1]


def test_tied_parameters_are_counted_once():
    model = tiny()
    model.output.weight = model.tok_embeddings.weight
    e = estimate_memory(model, plan=LLAMA_PLAN, data_parallel_size=1)
    assert e.parameters == 4 * (1576 - 128)


def test_dtensor_styles_split_like_the_named_ones_and_others_are_noted_as_unsplit():
    class Custom(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            return module

    named = ParallelPlan(tensor_parallel={"layers.*.attention.wq": "colwise"})
    torch_style = ParallelPlan(tensor_parallel={"layers.*.attention.wq": ColwiseParallel()})
    custom = ParallelPlan(tensor_parallel={"layers.*.attention.wq": Custom()})
    sizes = [
        estimate_memory(tiny(), plan=p, data_parallel_size=1, tensor_parallel_size=2) for p in (named, torch_style)
    ]
    assert sizes[0].parameters == sizes[1].parameters == 4 * (1576 - 2 * 32)
    unsplit = estimate_memory(tiny(), plan=custom, data_parallel_size=1, tensor_parallel_size=2)
    assert unsplit.parameters == 4 * 1576
    assert "'layers.0.attention.wq': Custom on Linear is counted unsplit" in str(unsplit)


def test_a_plan_without_units_gathers_the_whole_model_at_once():
    e = estimate_memory(tiny(), plan=ParallelPlan(), data_parallel_size=2)
    assert (e.largest_unit, e.gathered_unit) == ("(root)", 4 * 1576)


def test_a_parallelize_fn_is_refused_with_the_plan_to_pass_instead():
    with pytest.raises(TypeError, match=r"needs a `modelpar.plans.ParallelPlan`.*pass `modelpar.plans.LLAMA_PLAN`"):
        estimate_memory(tiny(), plan=parallelize_llama, data_parallel_size=2)  # type: ignore[arg-type]


def test_bad_arguments_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r'data_parallel_size="auto"\): an estimate has no cluster'):
        estimate(dp="auto")  # type: ignore[arg-type]
    with pytest.raises(MeshSizeError, match=r"`data_parallel_replicate_size=3` must divide"):
        estimate(4, 1, data_parallel_replicate_size=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide every dimension"):
        estimate(1, 3)
    with pytest.raises(ValueError, match=r"`optimizer='lion'` is not an optimizer the estimate knows"):
        estimate(optimizer="lion")
    with pytest.raises(ValueError, match=r"`gradient_accumulation='none'` is not a mode"):
        estimate(gradient_accumulation="none")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`precision='16-mixed'` is not supported"):
        estimate(precision="16-mixed")


def test_the_table_names_each_row_in_readable_units():
    table = str(estimate(2, 2))
    for row in ("parameters", "gradients", "optimizer states", "gathered unit", "unit gradients", "buffers"):
        assert row in table
    assert "2 data-parallel (shard group 2) x 2 tensor-parallel; precision 32-true" in table
    assert "adamw: 2 x fp32" in table
    assert "1.58 KiB" in table  # 1616 bytes of parameters
    assert "9216 B" not in table and "9.00 KiB" in table  # the total


def test_cli_prints_the_table_for_a_llama_config(capsys):
    config = json.dumps({"vocab_size": 16, "dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 16})
    assert main(["estimate", "--llama", config, "--dp", "2", "--tp", "2", "--optimizer", "adamw"]) == 0
    out = capsys.readouterr().out
    assert "Memory per rank: 2 data-parallel (shard group 2) x 2 tensor-parallel" in out
    assert "layers.0, fp32" in out


def test_cli_reports_a_wrong_llama_field_as_an_error(capsys):
    assert main(["estimate", "--llama", '{"hidden": 8}', "--dp", "2"]) == 2
    assert "error: --llama: ['hidden'] are not LlamaConfig fields" in capsys.readouterr().err


def test_cli_estimates_a_hugging_face_config_like_the_same_llama(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    config.save_pretrained(tmp_path)
    from modelpar.memory._estimate import hf_on_meta

    model, plan = hf_on_meta(tmp_path / "config.json")
    assert plan.fsdp_units == ("model.layers.*",)
    hf = estimate_memory(model, plan=plan, data_parallel_size=2, tensor_parallel_size=2, precision="bf16-mixed")
    # The same shapes as TINY, and the same split but for the embedding: Hugging Face's plan leaves an untied
    # embed_tokens whole on the tensor-parallel ranks (2-way FSDP only: 8 x 8 elements instead of 4 x 8).
    sharded = 404 + 32
    assert state(hf) == (4 * sharded, 4 * sharded, 8 * sharded, 2 * 336, 2 * 336)
    assert hf.largest_unit == "model.layers.0"
    assert main(["estimate", "--hf-config", str(tmp_path), "--dp", "2", "--tp", "2", "--cpu-offload"]) == 0
    assert "model.layers.0, fp32" in capsys.readouterr().out
    # What Hugging Face plans refuse is an error line and exit code 2, not a traceback.
    assert main(["estimate", "--hf-config", str(tmp_path), "--tp", "2", "--sequence-parallel"]) == 2
    assert capsys.readouterr().err.startswith("error: plan_for(..., sequence_parallel=True) is not supported")


def test_a_hugging_face_style_the_plan_cannot_translate_is_named():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from modelpar.hf._plan import plan_for

    config = LlamaConfig(
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=16,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.config.base_model_tp_plan = {"layers.*.mlp.down_proj": "local_packed_rowwise"}
    with pytest.raises(ValueError, match=r"maps 'model.layers.\*.mlp.down_proj' to the style 'local_packed_rowwise'"):
        plan_for(model)


HF_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_hidden_layers": 32,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}


def test_gpu_memory_sizes_parse_in_binary_and_decimal_units():
    from modelpar.memory._search import parse_memory

    assert parse_memory("80GiB") == 80 * 2**30
    assert parse_memory("80GB") == 80 * 10**9
    assert parse_memory("81920MiB") == 80 * 2**30
    with pytest.raises(ValueError, match=r"--gpu-memory '80 apples' is not a memory size"):
        parse_memory("80 apples")


def test_cli_search_lists_the_layouts_that_fit_best_first(tmp_path, capsys):
    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(HF_8B))
    argv = ["estimate", "--hf", str(tmp_path), "--world-size", "8", "--seq-len", "8192", "--precision", "bf16-mixed"]
    assert main([*argv, "--gpu-memory", "80GiB", "--search"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "best first: least recomputation" in lines[0]
    rows = [line.split() for line in lines[2:] if not line.startswith("...")]
    assert rows[0][:6] == ["8", "1", "1", "1", "1", "none"]  # plain FSDP over 8 ranks, no recomputation, fits
    assert all(float(row[6]) <= 80 for row in rows)
    order = ["none", "selective", "full"]
    assert [order.index(row[5]) for row in rows] == sorted(order.index(row[5]) for row in rows)
    assert main([*argv, "--gpu-memory", "8GiB", "--search"]) == 0
    assert "none of the 60 tried fits" in capsys.readouterr().out


def test_cli_search_refuses_missing_or_bad_arguments(tmp_path, capsys):
    config = json.dumps({"vocab_size": 16, "dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 16})
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--llama", config, "--search", "--seq-len", "8"])
    assert exit_info.value.code == 2
    assert "--search needs --world-size, --gpu-memory and --seq-len" in capsys.readouterr().err
    argv = ["estimate", "--llama", config, "--search", "--seq-len", "8", "--world-size", "4"]
    assert main([*argv, "--gpu-memory", "lots"]) == 2
    assert "error: --gpu-memory 'lots' is not a memory size" in capsys.readouterr().err
    assert main(["estimate", "--llama", config, "--seq-len", "9", "--cp", "2"]) == 2
    assert "must divide by 2 x context_parallel_size=2" in capsys.readouterr().err


def test_cli_prints_the_peak_with_activations(capsys):
    config = json.dumps({"vocab_size": 16, "dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 16})
    assert main(["estimate", "--llama", config, "--seq-len", "4", "--micro-batch", "2", "--ac", "selective"]) == 0
    out = capsys.readouterr().out
    assert "b 2 x seq 4, fp32, AC selective" in out and "layers, selective checkpointing" in out
    assert out.rstrip().splitlines()[-1].startswith("peak")


def test_cli_takes_compile_and_accumulated_micro_batches(capsys):
    config = json.dumps({"vocab_size": 16, "dim": 8, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 16})
    args = ["estimate", "--llama", config, "--seq-len", "4", "--micro-batch", "2"]
    assert main(args) == 0
    eager = capsys.readouterr().out
    assert main([*args, "--compile", "--accumulate-grad-batches", "3"]) == 0
    compiled = capsys.readouterr().out
    assert "assumes: eager" in eager and "beyond the activations backward frees" in eager
    assert "assumes: compiled blocks" in compiled and "kept over 3 micro-batches" in compiled


PP_LLAMA = json.dumps({"vocab_size": 16, "dim": 8, "n_layers": 4, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 16})


def test_cli_estimates_the_worst_pipeline_rank(capsys):
    args = ["estimate", "--llama", PP_LLAMA, "--dp", "2", "--seq-len", "8", "--micro-batch", "8"]
    assert main([*args, "--pipeline-parallel", "2", "--pipeline-microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "pipeline: 2 ranks, 1F1B, 4 micro-batches of 2; worst: pipeline rank 0 of 2" in out
    assert "stage 0 (tok_embeddings, layers.0, layers.1): at most 2 in flight" in out
    assert "stage 0 unsharded gradients" in out and out.rstrip().splitlines()[-1].startswith("peaks per pipeline rank")
    assert main([*args, "--pp", "2", "--pipeline-schedule", "Interleaved1F1B", "--pipeline-microbatches", "4"]) == 0
    assert "pipeline: 2 ranks x 2 stages per rank, Interleaved1F1B" in capsys.readouterr().out
    assert main([*args, "--pp", "2", "--pipeline-microbatches", "3"]) == 2
    assert "error: estimate_memory(micro_batch_size=8): under pipeline parallelism" in capsys.readouterr().err


def test_cli_search_lists_pipeline_sizes_and_refuses_a_fixed_one(capsys):
    args = ["estimate", "--llama", PP_LLAMA, "--search", "--world-size", "4", "--gpu-memory", "1GiB", "--seq-len", "8"]
    assert main([*args, "--micro-batch", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "then smallest tp, cp, pp, replicas" in lines[0]
    assert lines[1].split()[:6] == ["pp", "dp", "replicate", "cp", "tp", "ep"]
    rows = [line.split() for line in lines[2:] if not line.startswith("...")]
    assert {row[0] for row in rows} >= {"1", "2"}
    assert main([*args, "--micro-batch", "1"]) == 0  # one sample: no pipeline layout, no pp column
    assert capsys.readouterr().out.splitlines()[1].split()[0] == "dp"
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--pipeline-parallel", "2"])
    assert exit_info.value.code == 2
    assert "--pipeline-parallel applies without --search" in capsys.readouterr().err
