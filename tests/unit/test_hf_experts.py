"""Mixture-of-experts folders, one process: per-expert and fused layouts in, the family's layout out.

The model holds each layer's experts fused; folders written by transformers hold them per expert (Qwen3-MoE's
``experts.{e}.gate_proj.weight``, Mixtral's ``block_sparse_moe.experts.{e}.w1.weight``). The key mapping both
ways, pinned to transformers' own conversion rules, and the block cut that reads only some experts and rows.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from hf_tiny import TINY_SIZES
from modelpar import CheckpointKeyError, CheckpointShapeError
from modelpar.checkpoint import save_state
from modelpar.hf import export_checkpoint, load_pretrained, save_pretrained
from modelpar.hf._experts import LAYOUTS, MIXTRAL, QWEN2_MOE, SAVE_LAYOUTS, group_experts, split_for_save
from modelpar.hf._files import file_keys
from modelpar.hf._load import Handles, fill_block

FAMILIES = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **TINY_SIZES, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12
    ),
    "mixtral": lambda: MixtralConfig(**{**TINY_SIZES, "intermediate_size": 12}, num_local_experts=4),
}


def model_of(family: str, seed: int = 0) -> Any:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(FAMILIES[family]())


def file_names(folder: Path) -> set[str]:
    return set(file_keys(folder))


def assert_same_weights(got: torch.nn.Module, want: torch.nn.Module) -> None:
    want_state = want.state_dict()
    for name, value in got.state_dict().items():
        assert torch.equal(value, want_state[name]), name


def test_per_expert_names_group_into_the_fused_tensors_of_both_layouts():
    model = {"m.layers.0.mlp.experts.gate_up_proj", "m.layers.0.mlp.experts.down_proj", "m.layers.0.mlp.gate.weight"}
    qwen = {f"m.layers.0.mlp.experts.{e}.{p}.weight": "" for e in (1, 0) for p in ("up_proj", "gate_proj", "down_proj")}
    qwen["m.layers.0.mlp.gate.weight"] = ""
    direct, stacked = group_experts({k: k for k in qwen}, model)
    assert direct == {"m.layers.0.mlp.gate.weight": "m.layers.0.mlp.gate.weight"}
    assert stacked["m.layers.0.mlp.experts.gate_up_proj"].parts == tuple(
        (f"m.layers.0.mlp.experts.{e}.gate_proj.weight", f"m.layers.0.mlp.experts.{e}.up_proj.weight") for e in (0, 1)
    )  # experts in order, gate rows before up rows
    assert stacked["m.layers.0.mlp.experts.down_proj"].parts == tuple(
        (f"m.layers.0.mlp.experts.{e}.down_proj.weight",) for e in (0, 1)
    )
    mixtral = [f"m.layers.0.block_sparse_moe.experts.{e}.w{i}.weight" for e in (0, 1) for i in (1, 2, 3)]
    direct, stacked = group_experts({k: k for k in [*mixtral, "m.layers.0.block_sparse_moe.gate.weight"]}, model)
    assert direct == {"m.layers.0.block_sparse_moe.gate.weight": "m.layers.0.mlp.gate.weight"}  # the router
    assert stacked["m.layers.0.mlp.experts.gate_up_proj"].parts[1] == (
        "m.layers.0.block_sparse_moe.experts.1.w1.weight",
        "m.layers.0.block_sparse_moe.experts.1.w3.weight",
    )
    # A model without fused experts (a per-expert model of its own) keeps its names one to one.
    direct, stacked = group_experts({k: k for k in qwen}, set(qwen))
    assert stacked == {} and direct == {k: k for k in qwen}


def test_a_set_of_experts_with_gaps_is_named():
    model = {"m.mlp.experts.gate_up_proj", "m.mlp.experts.down_proj"}
    names = [f"m.mlp.experts.{e}.{p}.weight" for e in (0, 2) for p in ("gate_proj", "up_proj")]
    names.append("m.mlp.experts.1.gate_proj.weight")
    with pytest.raises(CheckpointKeyError, match=r"'m.mlp.experts.gate_up_proj'.*missing: \['experts.1.up_proj'\]"):
        group_experts({k: k for k in names}, model)
    direct, stacked = group_experts({k: k for k in names}, model, strict=False)  # left for load's own checks
    assert stacked == {} and direct == {k: k for k in names}


def test_fused_tensors_split_per_expert_for_saving_as_the_family_writes_them():
    full = torch.arange(2 * 6 * 3).reshape(2, 6, 3)
    cuts = split_for_save("model.layers.0.mlp.experts.gate_up_proj", (2, 6, 3), QWEN2_MOE)
    assert [(n, s) for n, s, _ in cuts] == [
        (f"model.layers.0.mlp.experts.{e}.{p}.weight", (3, 3)) for e in (0, 1) for p in ("gate_proj", "up_proj")
    ]
    assert torch.equal(cuts[3][2](full), full[1, 3:])  # expert 1's up rows
    cuts = split_for_save("model.layers.0.mlp.experts.down_proj", (2, 3, 6), MIXTRAL)
    assert [n for n, _, _ in cuts] == [f"model.layers.0.block_sparse_moe.experts.{e}.w2.weight" for e in (0, 1)]
    assert split_for_save("model.layers.0.mlp.gate.weight", (2, 3), MIXTRAL)[0][0] == (
        "model.layers.0.block_sparse_moe.gate.weight"
    )
    assert split_for_save("model.layers.0.mlp.experts.down_proj", (2, 3, 6), None)[0][:2] == (
        "model.layers.0.mlp.experts.down_proj",
        (2, 3, 6),
    )  # a family whose folders hold the experts fused


def test_the_layout_table_is_transformers_own_conversion_rules():
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    for model_type, layout in SAVE_LAYOUTS.items():
        rules = get_checkpoint_conversion_mapping(model_type)
        converters = {
            tuple(r.source_patterns): (r.target_patterns, [repr(op) for op in r.operations])
            for r in rules
            if isinstance(r, WeightConverter)
        }
        prefix = "." if layout is MIXTRAL else "mlp."
        gate_up = tuple(f"{prefix}experts.*.{p}.weight" for p in (layout.gate, layout.up))
        down = (f"{prefix}experts.*.{layout.down}.weight",)
        assert converters[gate_up][0] == [f"{prefix}experts.gate_up_proj"], model_type
        assert [op.split("(")[0] for op in converters[gate_up][1]] == ["MergeModulelist", "Concatenate"], model_type
        assert converters[down][0] == [f"{prefix}experts.down_proj"], model_type
        renames = [(r.source_patterns, r.target_patterns) for r in rules if isinstance(r, WeightRenaming)]
        assert renames == ([] if layout.block == "mlp" else [([f".{layout.block}."], [".mlp."])]), model_type
    assert {layout.name for layout in SAVE_LAYOUTS.values()} == {layout.name for layout in LAYOUTS}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_per_expert_and_fused_folders_load_like_from_pretrained(tmp_path, family):
    # Before: CheckpointKeyError (the fused tensors missing, the per-expert ones unexpected).
    model_of(family).save_pretrained(tmp_path / "hf")
    assert not any(name.endswith("gate_up_proj") for name in file_names(tmp_path / "hf"))
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    got = model_of(family, seed=1)
    load_pretrained(got, tmp_path / "hf")
    assert_same_weights(got, want)
    # A folder holding the experts fused, as the model does, in two files.
    (tmp_path / "fused").mkdir()
    state = {k: v.contiguous() for k, v in want.state_dict().items()}
    names = sorted(state)
    save_file({k: state[k] for k in names[::2]}, tmp_path / "fused" / "model-00001-of-00002.safetensors")
    save_file({k: state[k] for k in names[1::2]}, tmp_path / "fused" / "model-00002-of-00002.safetensors")
    index = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(names)}
    (tmp_path / "fused" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    got = model_of(family, seed=2)
    load_pretrained(got, tmp_path / "fused")
    assert_same_weights(got, want)


def test_per_expert_tensors_that_do_not_stack_raise_before_loading(tmp_path):
    model_of("qwen3_moe").save_pretrained(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    state["model.layers.1.mlp.experts.2.up_proj.weight"] = torch.zeros(5, 32)
    save_file(state, tmp_path / "hf" / "model.safetensors")
    model = model_of("qwen3_moe", seed=1)
    before = model.model.embed_tokens.weight.clone()
    with pytest.raises(CheckpointShapeError, match=r"'model.layers.1.mlp.experts.gate_up_proj'.*do not stack"):
        load_pretrained(model, tmp_path / "hf")
    assert torch.equal(model.model.embed_tokens.weight, before)


def test_a_block_of_experts_rows_and_columns_is_read_from_the_per_expert_tensors(tmp_path):
    # The cut a sharded rank makes: experts 1-2, rows 9..17 (across expert rows' gate/up boundary at 12), cols 3..7.
    model_of("qwen3_moe").save_pretrained(tmp_path / "hf")
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").model.layers[0].mlp.experts.gate_up_proj.detach()
    located = file_keys(tmp_path / "hf")
    _, stacked = group_experts({k: k for k in located}, {"model.layers.0.mlp.experts.gate_up_proj"})
    local = torch.full((2, 8, 4), float("nan"))
    with Handles(located) as handles:
        fill_block(handles, stacked["model.layers.0.mlp.experts.gate_up_proj"], local, [(1, 2), (9, 8), (3, 4)])
    assert torch.equal(local, want[1:3, 9:17, 3:7])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_save_and_export_write_the_familys_layout_which_from_pretrained_loads_with_identical_logits(tmp_path, family):
    # Before: the fused tensors were written as the model holds them, which is not transformers' layout.
    model_of(family).save_pretrained(tmp_path / "hf")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p), alpha=0.1)
    save_pretrained(model, tmp_path / "saved", max_shard_size="40KB")
    save_state(tmp_path / "ckpt", {"model": model}, full=False)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "exported", config=tmp_path / "hf", progress=False)
    x = torch.randint(0, TINY_SIZES["vocab_size"], (2, 9))
    for name in ("saved", "exported"):
        assert file_names(tmp_path / name) == file_names(tmp_path / "hf"), name
        back = AutoModelForCausalLM.from_pretrained(tmp_path / name)
        assert torch.equal(back(x).logits, model(x).logits), name
