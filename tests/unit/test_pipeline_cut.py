"""Pipeline parallelism without a process group: the mesh axis, the options, the schedules, the cut and the stages.

Everything here is what every rank computes alike before any collective, so each refusal is checked for its type
and message; the training itself is compared with one process in tests/distributed/test_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from modelpar import MeshLayout, MeshSizeError, PipelineSplitError
from modelpar._strategy.options import StrategyOptions
from modelpar.models import Llama, LlamaConfig
from modelpar.pipeline import OFFERED_SCHEDULES, StageLayers, balance, cut_model
from modelpar.pipeline._stage import prune, stage_view

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=64)


def _meta_llama(cfg: LlamaConfig = CFG) -> Llama:
    with torch.device("meta"):
        return Llama(cfg)


def test_pipeline_axis_is_outermost_and_every_other_size_is_per_stage() -> None:
    layout = MeshLayout.resolve("auto", 2, world_size=8, num_nodes=1, devices_per_node=8, pipeline_parallel_size=2)
    assert (layout.axes, layout.shape, layout.world_size) == (
        ("pipeline_parallel", "data_parallel", "tensor_parallel"),
        (2, 2, 2),
        8,
    )
    hsdp = MeshLayout.resolve(
        4, 1, world_size=8, num_nodes=1, devices_per_node=8, pipeline_parallel_size=2, data_parallel_replicate_size=2
    )
    assert hsdp.axes == ("pipeline_parallel", "data_parallel_replicate", "data_parallel_shard", "tensor_parallel")
    assert MeshLayout.resolve(2, 1, world_size=2, num_nodes=1, devices_per_node=2).axes == (
        "data_parallel",
        "tensor_parallel",
    )  # pp = 1 leaves the mesh as it was


def test_pipeline_sizes_that_do_not_fit_are_refused_with_the_stage_world_size() -> None:
    with pytest.raises(MeshSizeError, match=r"`pipeline_parallel_size=3` must divide the world size \(8\)"):
        MeshLayout.resolve("auto", 1, world_size=8, num_nodes=1, devices_per_node=8, pipeline_parallel_size=3)
    with pytest.raises(MeshSizeError, match=r"each stage's mesh has 4 of the 8 ranks.*`data_parallel_size=3`"):
        MeshLayout.resolve(3, 2, world_size=8, num_nodes=1, devices_per_node=8, pipeline_parallel_size=2)
    with pytest.raises(MeshSizeError, match="`pipeline_parallel_size=0` is not a valid size"):
        StrategyOptions(pipeline_parallel_size=0)


def test_schedule_options_are_checked_when_the_strategy_is_made() -> None:
    assert OFFERED_SCHEDULES == ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS")
    with pytest.raises(ValueError, match=r"`pipeline_schedule='2F2B'` is not a schedule. Use one of \['GPipe'"):
        StrategyOptions(pipeline_parallel_size=2, pipeline_schedule="2F2B")  # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match="loses part of the weight gradients under FSDP2"):
        StrategyOptions(pipeline_parallel_size=2, pipeline_schedule="ZBVZeroBubble")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"`pipeline_microbatches=3` is fewer than the 4 pipeline stages"):
        StrategyOptions(pipeline_parallel_size=2, pipeline_schedule="Interleaved1F1B", pipeline_microbatches=3)
    with pytest.raises(ValueError, match="runs one stage per rank, but `pipeline_stages_per_rank=2`"):
        StrategyOptions(pipeline_parallel_size=2, pipeline_stages_per_rank=2)
    with pytest.raises(ValueError, match="`pipeline_stages_per_rank=1` was given: it would run as a slower 1F1B"):
        StrategyOptions(pipeline_parallel_size=2, pipeline_schedule="LoopedBFS", pipeline_stages_per_rank=1)
    with pytest.raises(TypeError, match="`pipeline_split` must be one list of module names per stage"):
        StrategyOptions(pipeline_parallel_size=2, pipeline_split="layers.0")  # type: ignore[arg-type]


def test_balance_makes_the_first_and_last_stages_lighter_for_the_embedding_and_the_output() -> None:
    assert balance([1] * 8, 4) == [2, 2, 2, 2]
    assert balance([1] * 8, 4, first_extra=1, last_extra=1) == [2, 3, 2, 1]  # stage costs 3, 3, 2, 2
    assert balance([10] * 16, 4, first_extra=5, last_extra=20) == [4, 5, 5, 2]  # 45, 50, 50, 40
    with pytest.raises(ValueError, match="5 stages cannot share 4 blocks"):
        balance([1] * 4, 5)


def test_the_llama_cut_puts_embedding_first_output_last_and_rope_on_every_stage() -> None:
    cut = cut_model(_meta_llama(), 4)
    assert cut.container == "layers" and cut.shared == ("rope",)
    assert cut.stages[0][0] == "tok_embeddings" and cut.stages[-1][-2:] == ("norm", "output")
    blocks = [name for stage in cut.stages for name in stage if name.startswith("layers.")]
    assert blocks == [f"layers.{i}" for i in range(8)]  # contiguous, in order, each once


def test_models_the_split_cannot_cut_are_refused_with_the_fix() -> None:
    with pytest.raises(PipelineSplitError, match=r"9 pipeline stages .* but Llama has only 8 blocks in `layers`"):
        cut_model(_meta_llama(), 9)
    with pytest.raises(PipelineSplitError, match="has no repeated blocks"):
        cut_model(nn.Linear(4, 4), 2)
    tied = _meta_llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64))
    tied.output.weight = tied.tok_embeddings.weight
    with pytest.raises(PipelineSplitError, match=r"tied weights .* cannot be split across pipeline stages"):
        cut_model(tied, 2)


def test_a_hand_written_split_must_cover_every_parameter_once() -> None:
    model = _meta_llama()
    first = ["tok_embeddings", *(f"layers.{i}" for i in range(3))]
    last = [*(f"layers.{i}" for i in range(3, 8)), "norm", "output"]
    assert cut_model(model, 2, [first, last]).stages == (tuple(first), tuple(last))
    with pytest.raises(PipelineSplitError, match="names 1 stages, but the pipeline has 2"):
        cut_model(model, 2, [first + last])
    with pytest.raises(PipelineSplitError, match=r"leaves parameters of `output` in no stage"):
        cut_model(model, 2, [first, last[:-1]])
    with pytest.raises(PipelineSplitError, match=r"puts `layers\.3` in stages 0 and 1"):
        cut_model(model, 2, [[*first, "layers.3"], last])
    with pytest.raises(PipelineSplitError, match=r"names `layers\.99`, which is not a submodule"):
        cut_model(model, 2, [[*first, "layers.99"], last])


def test_a_stage_keeps_the_unsplit_names_and_runs_its_blocks_in_order() -> None:
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=64))
    cut = cut_model(model, 2)
    first, last = (stage_view(model, names) for names in cut.stages)
    assert isinstance(first.layers, StageLayers) and list(first.layers.keys()) == ["0", "1"]
    assert first.output is None and last.tok_embeddings is None and model.output is not None  # views only
    tokens = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(last(first(tokens)), model(tokens))  # the stages chained are the whole model
    assert {n for n, _ in last.named_parameters()} == {
        n for n, _ in model.named_parameters() if n.startswith(("layers.2.", "layers.3.", "norm.", "output."))
    }
    prune(model, cut.stages[1])
    assert model.tok_embeddings is None and list(model.layers.keys()) == ["2", "3"]
    assert len(model.layers[:8]) == 2 and [type(b).__name__ for b in model.layers] == ["TransformerBlock"] * 2


def test_hugging_face_families_that_cannot_run_as_stages_are_refused_by_name() -> None:
    from transformers import AutoModelForCausalLM, GemmaConfig

    from hf_tiny import TINY_SIZES, tiny_config
    from modelpar.pipeline._hf import check_hugging_face_pipeline

    with torch.device("meta"):
        check_hugging_face_pipeline(AutoModelForCausalLM.from_config(tiny_config()))  # Llama: a plain decoder
        # Gemma scales its embeddings inside `embed_tokens` (transformers 5.17-5.24), so later stages do not
        check_hugging_face_pipeline(AutoModelForCausalLM.from_config(GemmaConfig(**{**TINY_SIZES, "head_dim": 8})))
        unplanned = AutoModelForCausalLM.from_config(tiny_config())
    unplanned.config.base_model_pp_plan = None
    with pytest.raises(PipelineSplitError, match=r"LlamaForCausalLM declares no pipeline plan"):
        check_hugging_face_pipeline(unplanned)
    unplanned.config.base_model_pp_plan = {"embed_tokens": 0, "layers": 0, "norm": 0, "vision_tower": 0}
    with pytest.raises(PipelineSplitError, match=r"passes \['embed_tokens', 'layers', 'norm', 'vision_tower'\]"):
        check_hugging_face_pipeline(unplanned)
