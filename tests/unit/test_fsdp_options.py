"""The FSDP2 options a strategy derives from its arguments and precision, and the ones it refuses (no process)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from modelpar import ModelParallelStrategy
from modelpar._train.fsdp import FSDPOptions

CPU = torch.device("cpu")


def resolve(**kwargs):
    args = {"mixed_precision": None, "cpu_offload": False, "reshard_after_forward": None, "precision": "32-true"}
    return FSDPOptions.resolve(**(args | kwargs), device=CPU, shard_size=4, strategy_name="ModelParallelStrategy")


def identity(model, mesh):
    return model


def test_bf16_mixed_derives_bf16_compute_with_fp32_reduction_and_nothing_else_casts():
    bf16 = resolve(precision="bf16-mixed")
    assert bf16.mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert bf16.casts_parameters and bf16.explicit == ()
    for precision in ("32-true", "bf16-true", "16-true"):
        assert resolve(precision=precision).mp_policy == MixedPrecisionPolicy()
    mine = MixedPrecisionPolicy(param_dtype=torch.float16)
    assert resolve(precision="bf16-mixed", mixed_precision=mine).mp_policy is mine  # an explicit policy wins


def test_cpu_offload_pins_only_where_there_is_an_accelerator():
    offload = resolve(cpu_offload=True)
    assert isinstance(offload.offload_policy, CPUOffloadPolicy) and offload.offload_policy.pin_memory is False
    assert offload.explicit == ("cpu_offload",)
    assert type(resolve().offload_policy) is OffloadPolicy
    if not torch.accelerator.is_available():
        with pytest.raises(
            ValueError, match=r"needs an accelerator: pinned memory .* `CPUOffloadPolicy\(pin_memory=False\)`"
        ):
            resolve(cpu_offload=CPUOffloadPolicy(pin_memory=True))


def test_reshard_after_forward_int_must_divide_the_shard_group():
    assert resolve(reshard_after_forward=2).reshard_after_forward == 2
    assert resolve(reshard_after_forward=False).kwargs()["reshard_after_forward"] is False
    with pytest.raises(ValueError) as e:
        resolve(reshard_after_forward=3)
    assert str(e.value) == (
        "`ModelParallelStrategy(reshard_after_forward=3)`: an int reshards to that many ranks after forward and must"
        " divide the shard group (4 ranks) other than 1 and itself. Pass one of [2]."
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mixed_precision": "bf16"}, r"`mixed_precision` must be a `torch.distributed.fsdp.MixedPrecisionPolicy`"),
        ({"cpu_offload": "yes"}, r"`cpu_offload` must be a bool or a `torch.distributed.fsdp.CPUOffloadPolicy`"),
        ({"reshard_after_forward": "always"}, r"`reshard_after_forward` must be True, False, an int"),
    ],
)
def test_bad_option_types_are_refused_at_construction(kwargs, message):
    with pytest.raises(TypeError, match=message):
        ModelParallelStrategy(identity, **kwargs)


def test_gradient_accumulation_mode_is_checked():
    with pytest.raises(ValueError, match=r"`gradient_accumulation='none'` is not a mode. Use 'sharded'"):
        ModelParallelStrategy(identity, gradient_accumulation="none")


def test_only_the_derived_bf16_policy_casts_the_root_outputs_to_fp32():
    assert resolve(precision="bf16-mixed").root_output_dtype == torch.float32
    assert resolve(precision="bf16-mixed").mp_policy.output_dtype is None  # the units' policy: no per-block casts
    mine = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert resolve(precision="bf16-mixed", mixed_precision=mine).root_output_dtype is None  # used as given
    for precision in ("32-true", "bf16-true", "16-true"):
        assert resolve(precision=precision).root_output_dtype is None


def test_fused_experts_fewer_than_the_shard_ranks_are_sharded_evenly_on_a_later_dim() -> None:
    from modelpar._train.fsdp import fsdp_shard_dim

    assert fsdp_shard_dim((8, 28672, 4096), 32) == 1  # Mixtral's gate_up over 32 ranks: not 8 whole experts
    assert fsdp_shard_dim((8, 4096, 14336), 32) == 1
    assert fsdp_shard_dim((8, 4095, 14336), 32) == 2  # the first later dim that divides
    assert fsdp_shard_dim((8, 4095, 14335), 32) == 0  # none divides: FSDP2's padded dim-0 chunks
    assert fsdp_shard_dim((64, 512, 512), 32) == 0  # enough experts: dim 0, as FSDP2 does
    assert fsdp_shard_dim((8, 4096), 32) == 0  # not fused experts
