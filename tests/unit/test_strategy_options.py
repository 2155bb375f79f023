"""The strategy's options travel as one value (``StrategyOptions``), and both front ends declare every one of them.

A new option is declared once (its field and validation) and spelled in each front end's signature, which stays
explicit and typed for IDEs and docs; this test is what keeps the three in step.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from modelpar import MeshSizeError
from modelpar._strategy.options import StrategyOptions
from modelpar.fabric import ModelParallelStrategy as FabricStrategy
from modelpar.legacy import FSDP1_ARGUMENTS
from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

FIELDS = {f.name: f.default for f in dataclasses.fields(StrategyOptions) if not f.metadata.get("derived")}
#: Lightning FSDPStrategy's arguments, taken under their own names and folded into the options (``None``: not given).
FSDP1 = dict.fromkeys(FSDP1_ARGUMENTS)


@pytest.mark.parametrize("front_end", [FabricStrategy, TrainerStrategy], ids=["fabric", "trainer"])
def test_every_option_is_in_each_front_ends_signature_with_the_same_default(front_end):
    parameters = inspect.signature(front_end.__init__).parameters
    missing = sorted(set(FIELDS) - set(parameters))
    assert not missing, f"{front_end.__module__} does not take {missing}: add them to its signature"
    differing = {n: (parameters[n].default, d) for n, d in FIELDS.items() if parameters[n].default != d}
    assert not differing, differing


@pytest.mark.parametrize("front_end", [FabricStrategy, TrainerStrategy], ids=["fabric", "trainer"])
def test_each_front_end_takes_lightning_fsdp_strategys_arguments_and_refuses_any_other(front_end):
    parameters = inspect.signature(front_end.__init__).parameters
    assert {n: parameters[n].default for n in FSDP1 if n in parameters} == FSDP1
    assert parameters["kwargs"].kind is inspect.Parameter.VAR_KEYWORD  # refused by name, never swallowed
    with pytest.raises(TypeError, match="got an unexpected keyword argument 'sharding'"):
        front_end(sharding="FULL_SHARD")


@pytest.mark.parametrize("front_end", [FabricStrategy, TrainerStrategy], ids=["fabric", "trainer"])
def test_the_front_ends_hand_the_core_exactly_what_they_were_given(front_end):
    strategy = front_end(
        parallelize_fn=lambda model, mesh: model,
        data_parallel_size=2,
        tensor_parallel_size=1,
        reshard_after_forward=False,
    )
    options = strategy._core.options
    assert isinstance(options, StrategyOptions)
    assert (options.data_parallel_size, options.tensor_parallel_size, options.reshard_after_forward) == (2, 1, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.async_save = True  # type: ignore[misc]


def test_pick_takes_the_declared_fields_and_nothing_else():
    arguments = {**FIELDS, **FSDP1, "self": object(), "accelerator": None, "data_parallel_size": 4}
    assert StrategyOptions.pick(arguments) == StrategyOptions(data_parallel_size=4)
    arguments = {**arguments, "sharding_strategy": "SHARD_GRAD_OP", "state_dict_type": "full"}
    assert StrategyOptions.pick(arguments) == StrategyOptions(
        data_parallel_size=4,
        reshard_after_forward=False,
        save_distributed_checkpoint=False,
        fsdp1_arguments=("sharding_strategy", "state_dict_type"),
    )
    with pytest.raises(KeyError):
        StrategyOptions.pick({"data_parallel_size": 4})  # a front end that forgot an option fails loudly


def test_options_are_validated_when_made_with_the_strategys_messages():
    with pytest.raises(MeshSizeError, match="`data_parallel_size=0` is not a valid size"):
        StrategyOptions(data_parallel_size=0)
    with pytest.raises(TypeError, match=r"`timeout` must be a `datetime\.timedelta`"):
        StrategyOptions(timeout=30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="`gradient_accumulation='whole'` is not a mode"):
        StrategyOptions(gradient_accumulation="whole")  # type: ignore[arg-type]
