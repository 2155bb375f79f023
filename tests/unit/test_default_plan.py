"""The units the strategy chooses when nobody wrote a plan: by option, by ``_no_split_modules``, by repeated blocks.

Read on meta-device models in one process: what every rank decides identically before any collective. The
training itself (against one process, 2 and 4 ranks) is ``tests/distributed/test_no_code.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from modelpar._strategy.default_plan import default_plan
from modelpar.models import Llama, LlamaConfig
from modelpar.models.llama import TransformerBlock
from modelpar.plans import ParallelPlan
from modelpar.plans._checks import resolve_units
from modelpar.plans._units import repeated_blocks

CFG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)


def _plan(model: nn.Module, **kwargs: object) -> ParallelPlan:
    options = {"fsdp_units": None, "activation_checkpointing": None, "tensor_parallel_size": 1}
    return default_plan(model, **{**options, **kwargs}, expert_parallel_size=1, strategy_name="S")  # type: ignore[arg-type]


def _meta(build: object) -> nn.Module:
    with torch.device("meta"):
        return build()  # type: ignore[operator,no-any-return]


class _Stages(nn.Module):
    """A ResNet-like model: two Sequentials of blocks (one longer), a stem and a head outside them."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 16)
        self.small = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2)))
        self.big = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32) for _ in range(3))
        self.head = nn.Linear(16, 4)


def test_the_reference_llama_is_sharded_by_its_transformer_blocks():
    model = _meta(lambda: Llama(CFG))
    found = repeated_blocks(model)
    assert found is not None and found.cls is TransformerBlock and found.names == ("layers.0", "layers.1", "layers.2")
    assert resolve_units(model, _plan(model).fsdp_units) == ["layers.0", "layers.1", "layers.2"]


def test_the_largest_container_of_one_class_wins_and_containers_of_containers_do_not_count():
    model = _meta(_Stages)
    assert resolve_units(model, _plan(model).fsdp_units) == ["big.0", "big.1", "big.2"]


@pytest.mark.parametrize("family", ["llama", "qwen3", "mixtral"])
def test_hugging_face_models_are_sharded_by_their_no_split_modules(family):
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3Config

    from hf_tiny import TINY_SIZES

    configs = {
        "llama": lambda: LlamaConfig(**TINY_SIZES),
        "qwen3": lambda: Qwen3Config(head_dim=8, **TINY_SIZES),
        "mixtral": lambda: MixtralConfig(**TINY_SIZES, num_local_experts=4, num_experts_per_tok=2),
    }
    model = _meta(lambda: AutoModelForCausalLM.from_config(configs[family]()))
    units = resolve_units(model, _plan(model).fsdp_units)
    assert units == ["model.layers.0", "model.layers.1"]
    assert {type(model.get_submodule(u)).__name__ for u in units} <= set(model._no_split_modules)


def test_a_hugging_face_model_takes_its_own_tensor_parallel_plan():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_tiny import TINY_SIZES

    model = _meta(lambda: AutoModelForCausalLM.from_config(LlamaConfig(**TINY_SIZES)))
    plan = _plan(model, tensor_parallel_size=2)
    assert plan.tensor_parallel["model.layers.*.self_attn.q_proj"] == "colwise"
    assert resolve_units(model, plan.fsdp_units) == ["model.layers.0", "model.layers.1"]


def test_tensor_parallelism_without_a_plan_is_refused_naming_the_ready_plan():
    model = _meta(lambda: Llama(CFG))
    with pytest.raises(ValueError, match=r"^`tensor_parallel_size=2` needs a plan: .*`modelpar\.plans\.LLAMA_PLAN`"):
        _plan(model, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"or set `tensor_parallel_size=1`\.$"):
        _plan(_meta(_Stages), tensor_parallel_size=2)


def test_given_units_and_checkpointing_by_class_or_mode_are_taken_as_given():
    model = _meta(lambda: Llama(CFG))
    plan = _plan(model, fsdp_units=frozenset({TransformerBlock}), activation_checkpointing="selective")
    assert plan.activation_checkpointing == "selective"
    assert resolve_units(model, plan.fsdp_units) == ["layers.0", "layers.1", "layers.2"]
    by_class = _plan(model, activation_checkpointing=frozenset({TransformerBlock}))
    assert by_class.checkpointed(model, ["layers.0"]) == ("full", ["layers.0", "layers.1", "layers.2"])


def test_a_model_without_repeated_blocks_is_one_unit_with_a_warning_and_checkpointing_it_is_refused():
    model = _meta(lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = _plan(model)
    assert plan.fsdp_units == ()
    assert [str(w.message) for w in caught if "no repeated blocks" in str(w.message)] == [
        "`S` found no repeated blocks in Sequential (no `nn.ModuleList` or `nn.Sequential` of one class), so it"
        " shards the whole model as one FSDP unit: every forward and backward all-gathers all 212 parameters at"
        " once, so the peak holds the whole model unsharded. Name the units with `fsdp_units={Block}` (classes,"
        " patterns or a predicate) to gather one block at a time."
    ]
    with pytest.raises(ValueError, match=r"`activation_checkpointing='full'` recomputes the FSDP units, but"):
        _plan(model, activation_checkpointing="full")
