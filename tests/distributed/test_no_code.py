"""FSDP2 with no code: ``ModelParallelStrategy()`` without a ``parallelize_fn``, against one process.

One spawn of 2 processes and one of 4 (two simulated nodes of two, so ``HYBRID_SHARD`` has nodes to replicate
across). Each case runs in every rank: the strategy picks the units itself (the reference Llama's repeated blocks,
a Hugging Face model's ``_no_split_modules``), and losses, gradients and weights after AdamW steps equal the
one-process run of the same model on the same data. Refusals are compared across ranks: the same type and
message everywhere, before any collective.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from harness import PG_TIMEOUT, run_distributed
from hf_tiny import TINY_SIZES
from modelpar import ModelParallelStrategy
from parity import adamw, assert_matches, error_text, global_batches, lm_loss, local_slice, reference_model

STEPS = 3
LR = 1e-2


class _Records(logging.Handler):
    """What rank 0 logged through Lightning's rank-zero logger (the units line)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _fabric(world_size: int, num_nodes: int = 1, **strategy_kwargs: Any) -> Fabric:
    strategy = ModelParallelStrategy(timeout=PG_TIMEOUT, **strategy_kwargs)
    fabric = Fabric(accelerator="cpu", devices=world_size // num_nodes, num_nodes=num_nodes, strategy=strategy)
    fabric.launch()
    return fabric


def _units(model: torch.nn.Module) -> list[str]:
    return [n for n, m in getattr(model, "module", model).named_modules() if n and isinstance(m, FSDPModule)]


def _train_against_reference(fabric: Fabric, ref: torch.nn.Module, forward: Any) -> dict[str, float]:
    """AdamW steps on the sharded copy and on ``ref``; losses, gradients and weights compared after each."""
    model = fabric.setup_module(copy.deepcopy(ref))
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=LR, weight_decay=0.1))
    ref_opt = adamw(ref.parameters(), lr=LR, weight_decay=0.1)
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for x, y in global_batches(STEPS):
        loss = lm_loss(forward(model, local_slice(fabric, x)), local_slice(fabric, y))
        fabric.backward(loss)
        ref_loss = lm_loss(forward(ref, x), y)
        ref_loss.backward()
        got = fabric.all_reduce(loss.detach(), reduce_op="mean")
        worst["loss"] = max(worst["loss"], abs(got.item() - ref_loss.item()))
        worst["grad"] = max(worst["grad"], assert_matches(model, ref, "grad"))
        optimizer.step()
        ref_opt.step()
        optimizer.zero_grad()
        ref_opt.zero_grad()
        worst["param"] = max(worst["param"], assert_matches(model, ref, "param"))
    assert worst["loss"] < 1e-5, worst
    return {**worst, "units": _units(model), "mesh": tuple(fabric.strategy.device_mesh.shape)}  # type: ignore[dict-item]


def _llama_forward(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _hf_forward(model: Any, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits


def _hf_model(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config = {"llama": lambda: LlamaConfig(**TINY_SIZES), "qwen3": lambda: Qwen3Config(head_dim=8, **TINY_SIZES)}
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config[family]())


# ---------------------------------------------------------------------------------------------------
# cases (run inside every rank)
# ---------------------------------------------------------------------------------------------------
def case_llama(world_size: int, num_nodes: int = 1, **strategy_kwargs: Any) -> dict[str, Any]:
    records = _Records()
    from lightning_utilities.core import rank_zero

    logger = rank_zero.log  # whichever Lightning package set it: rank_zero_info logs through it
    logger.addHandler(records)
    try:
        fabric = _fabric(world_size, num_nodes, **strategy_kwargs)
        out = _train_against_reference(fabric, reference_model(), _llama_forward)
    finally:
        logger.removeHandler(records)
    return {**out, "log": [line for line in records.lines if "FSDP2 units" in line]}


def case_hf(family: str, world_size: int, num_nodes: int = 1, **strategy_kwargs: Any) -> dict[str, Any]:
    fabric = _fabric(world_size, num_nodes, **strategy_kwargs)
    out = _train_against_reference(fabric, _hf_model(family), _hf_forward)
    return {**out, "tp": fabric.strategy.device_mesh["tensor_parallel"].size()}


def case_selective_checkpointing_by_class(world_size: int) -> dict[str, Any]:
    """``activation_checkpointing={TransformerBlock}``: those modules recompute, training still equals one process."""
    from modelpar.models.llama import TransformerBlock

    fabric = _fabric(world_size, fsdp_units={TransformerBlock}, activation_checkpointing="selective")
    out = _train_against_reference(fabric, reference_model(), _llama_forward)
    return out


def case_refusals(world_size: int) -> dict[str, str]:
    """The same error, type and message, on every rank, before any collective of the model's set-up."""
    fabric = _fabric(world_size, tensor_parallel_size=2)
    out = {"tp_without_plan": error_text(lambda: fabric.setup_module(reference_model()))}
    from modelpar.plans import parallelize_llama

    out["units_and_fn"] = error_text(lambda: ModelParallelStrategy(parallelize_llama, fsdp_units=("layers.*",)))
    out["no_shard"] = error_text(lambda: ModelParallelStrategy(sharding_strategy="NO_SHARD"))
    out["fsdp1_kwarg"] = error_text(lambda: ModelParallelStrategy(backward_prefetch="BACKWARD_PRE"))
    dist.barrier()  # nobody hangs: every rank got here
    return out


def case_no_repeated_blocks(world_size: int) -> dict[str, Any]:
    """A model without repeated blocks is one unit (the root), with a warning that says what that costs."""
    import warnings

    fabric = _fabric(world_size)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = fabric.setup_module(model)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    return {
        "sharded": sharded,
        "units": _units(model),
        "warned": [str(w.message) for w in caught if "no repeated blocks" in str(w.message)],
    }


def case_sync_module_states(world_size: int) -> dict[str, Any]:
    """``sync_module_states=True``: ranks built with different seeds all end with rank 0's weights; a model real on
    one rank and meta on another is refused on every rank instead of hanging."""
    from parity import full

    fabric = _fabric(world_size, sync_module_states=True)
    model = fabric.setup_module(reference_model(seed=100 + fabric.global_rank))
    rank0 = reference_model(seed=100).state_dict()
    worst = max((full(v) - rank0[k]).abs().max().item() for k, v in model.module.state_dict().items())
    if fabric.global_rank == 0:
        mixed = reference_model()
    else:
        with torch.device("meta"):
            mixed = reference_model()
    return {"worst": worst, "mixed": error_text(lambda: fabric.setup_module(mixed))}


def run_two(_: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"llama": case_llama(2)}
    out["qwen3"] = case_hf("qwen3", 2)
    out["llama_hf_tp"] = case_hf("llama", 2, tensor_parallel_size=2)
    out["ac_by_class"] = case_selective_checkpointing_by_class(2)
    out["refusals"] = case_refusals(2)
    out["no_blocks"] = case_no_repeated_blocks(2)
    out["sync"] = case_sync_module_states(2)
    return out


def run_four(_: Any = None) -> dict[str, Any]:
    out: dict[str, Any] = {"llama": case_llama(4, 2)}
    out["hybrid"] = case_llama(4, 2, sharding_strategy="HYBRID_SHARD")
    out["device_mesh"] = case_llama(4, 2, sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))
    out["llama_hf"] = case_hf("llama", 4, 2)
    out["qwen3_hsdp"] = case_hf("qwen3", 4, 2, sharding_strategy="HYBRID_SHARD")
    return out


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return run_distributed(run_two, 2)


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return run_distributed(run_four, 4, nodes=2)


def test_no_code_strategy_shards_the_reference_llama_by_its_blocks_and_trains_like_one_process(two, four):
    for results, world in ((two, 2), (four, 4)):
        llama = results[0]["llama"]
        assert llama["units"] == ["layers.0", "layers.1"], llama
        assert llama["mesh"] == (world, 1)
        assert llama["log"] == [
            "ModelParallelStrategy: FSDP2 units of Llama (its repeated blocks): 2 x TransformerBlock, then the root."
        ]
        assert all(r["llama"]["log"] == [] for r in results[1:])  # rank 0 only


def test_hybrid_shard_replicates_per_node_and_trains_like_one_process(four):
    assert four[0]["hybrid"]["mesh"] == (2, 2, 1) and four[0]["device_mesh"]["mesh"] == (2, 2, 1)


def test_hugging_face_models_shard_by_their_no_split_modules(two, four):
    assert two[0]["qwen3"]["units"] == ["model.layers.0", "model.layers.1"]
    assert four[0]["llama_hf"]["units"] == ["model.layers.0", "model.layers.1"]
    assert four[0]["qwen3_hsdp"]["units"] == ["model.layers.0", "model.layers.1"]
    assert four[0]["qwen3_hsdp"]["mesh"] == (2, 2, 1)


def test_tensor_parallelism_of_a_hugging_face_model_takes_its_own_plan(two):
    assert two[0]["llama_hf_tp"]["tp"] == 2 and two[0]["llama_hf_tp"]["mesh"] == (1, 2)


def test_activation_checkpointing_options_train_like_one_process(two):
    assert two[0]["ac_by_class"]["units"] == ["layers.0", "layers.1"]


def test_refusals_are_the_same_on_every_rank_with_type_and_fix(two):
    first = two[0]["refusals"]
    assert all(r["refusals"] == first for r in two)
    assert first["tp_without_plan"].startswith("ValueError: `tensor_parallel_size=2` needs a plan:")
    assert "`modelpar.plans.LLAMA_PLAN` for Llama" in first["tp_without_plan"]
    assert first["units_and_fn"].startswith("ValueError: `fsdp_units` choose what the strategy shards")
    assert first["no_shard"].startswith("ValueError: `sharding_strategy='NO_SHARD'`")
    assert first["fsdp1_kwarg"].startswith("TypeError: `backward_prefetch` is an FSDP1 argument")


def test_a_model_without_repeated_blocks_is_one_unit_with_a_warning(two):
    result = two[0]["no_blocks"]
    assert result["sharded"] and result["units"] == []
    assert len(result["warned"]) == 1 and "all-gathers all 212 parameters at once" in result["warned"][0]


def test_sync_module_states_gives_every_rank_rank_zeros_weights_and_refuses_mixed_meta_models(two):
    assert all(r["sync"]["worst"] == 0.0 for r in two)
    assert two[0]["sync"]["mixed"] == two[1]["sync"]["mixed"]
    assert two[0]["sync"]["mixed"].startswith(
        "ValueError: `sync_module_states=True` broadcasts rank 0's weights, but ranks [1] hold meta tensors"
    )
