"""What the strategy says about bad arguments and early use, before any process exists."""

from datetime import timedelta

import pytest
import torch
from lightning_fabric import Fabric
from lightning_fabric.plugins import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning_fabric.plugins.io import TorchCheckpointIO

import modelpar
from modelpar import ModelParallelStrategy


def identity(model, mesh):
    return model


def test_public_surface_is_what_we_mean():
    assert set(modelpar.__all__) == {
        "ModelParallelStrategy",
        "MeshLayout",
        "MESH_AXES",
        "HSDP_MESH_AXES",
        "fsdp_kwargs",
        "fsdp_mesh",
        "estimate_memory",
        "MemoryEstimate",
        "SUPPORTED_PRECISIONS",
        "clip_grad_norm",
        "clip_grad_value",
        "MeshSizeError",
        "PipelineSplitError",
        "ShardingStrategyError",
        "CheckpointNotFoundError",
        "CheckpointKeyError",
        "CheckpointShapeError",
        "CorruptCheckpointError",
        "WeightsOnlyError",
        "UnsupportedReduceOpError",
        "UnsupportedStyleError",
        "__version__",
    }
    assert modelpar.MESH_AXES == ("data_parallel", "tensor_parallel")
    assert modelpar.HSDP_MESH_AXES == ("data_parallel_replicate", "data_parallel_shard", "tensor_parallel")


def test_invalid_sizes_are_rejected_at_construction():
    with pytest.raises(ValueError, match=r"`data_parallel_size=0` is not a valid size"):
        ModelParallelStrategy(identity, data_parallel_size=0)


def test_parallelize_fn_may_be_left_out_but_must_be_callable():
    assert ModelParallelStrategy()._core.parallelize_fn is None  # the strategy shards the model itself
    with pytest.raises(TypeError, match=r"must be a callable `\(model, device_mesh\) -> model`, but got int"):
        ModelParallelStrategy(3)  # type: ignore[arg-type]


def test_timeout_must_be_a_timedelta():
    with pytest.raises(TypeError, match=r"`timeout` must be a `datetime.timedelta`, but got 30"):
        ModelParallelStrategy(identity, timeout=30)  # type: ignore[arg-type]
    assert ModelParallelStrategy(identity, timeout=timedelta(seconds=5))._core.timeout == timedelta(seconds=5)


def test_device_mesh_before_setup_says_when_it_will_exist():
    with pytest.raises(
        RuntimeError,
        match=r"Accessing the device mesh before it exists is not allowed: .* created in `setup_environment\(\)`",
    ):
        ModelParallelStrategy(identity).device_mesh


def test_checkpoint_io_cannot_be_read_or_set():
    strategy = ModelParallelStrategy(identity)
    with pytest.raises(NotImplementedError, match=r"does not use the `CheckpointIO` plugin"):
        strategy.checkpoint_io
    with pytest.raises(
        NotImplementedError, match=r"does not support setting a `CheckpointIO` plugin \(TorchCheckpointIO"
    ):
        strategy.checkpoint_io = TorchCheckpointIO()


@pytest.mark.parametrize(
    "precision",
    [Precision(), MixedPrecision("bf16-mixed", "cpu"), HalfPrecision("bf16-true"), HalfPrecision("16-true")],
)
def test_supported_precisions_are_accepted(precision):
    strategy = ModelParallelStrategy(identity, precision=precision)
    assert strategy.precision is precision


def test_fp16_mixed_precision_is_refused_with_the_reason_and_alternatives():
    with pytest.raises(ValueError) as e:
        ModelParallelStrategy(identity, precision=MixedPrecision("16-mixed", "cuda"))
    assert "does not support precision '16-mixed'" in str(e.value)
    assert "Use precision='bf16-mixed'" in str(e.value)
    assert "Choose one of: 32-true, bf16-mixed, bf16-true, 16-true." in str(e.value)


def test_fp16_mixed_through_fabric_is_refused_even_on_cpu():
    # Fabric would otherwise turn it into bf16-mixed on CPU; it checks model-parallel strategies first.
    with pytest.raises(ValueError, match=r"does not support .*16-mixed"):
        Fabric(strategy=ModelParallelStrategy(identity), devices=1, precision="16-mixed")


def test_strategy_is_recognized_by_lightning_as_a_model_parallel_strategy():
    from lightning_fabric.strategies import ModelParallelStrategy as LightningModelParallelStrategy
    from lightning_fabric.strategies import ParallelStrategy

    strategy = ModelParallelStrategy(identity)
    assert isinstance(strategy, LightningModelParallelStrategy) and isinstance(strategy, ParallelStrategy)


def test_other_precisions_are_refused_also_through_fabric():
    with pytest.raises(ValueError, match=r"does not support precision '64-true' \(DoublePrecision\)"):
        ModelParallelStrategy(identity, precision=DoublePrecision())
    with pytest.raises(ValueError, match=r"does not support .*64-true.* among: 32-true, bf16-mixed"):
        Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(identity), precision="64-true")


def test_standalone_precision_defaults_to_32_true():
    assert ModelParallelStrategy(identity).precision.precision == "32-true"


def test_storage_options_are_refused_for_local_paths_before_anything_is_written(tmp_path):
    strategy = ModelParallelStrategy(identity)
    with pytest.raises(TypeError, match=r"storage_options=\.\.\.\)` is not supported for the local path"):
        strategy.save_checkpoint(tmp_path / "c", {"model": torch.nn.Linear(1, 1)}, storage_options={})
    assert not (tmp_path / "c").exists()


def test_urls_reach_fsspec_whole_with_the_strategys_and_the_calls_storage_options():
    from modelpar.checkpoint._remote import RemotePath

    strategy = ModelParallelStrategy(identity, storage_options={"skip_instance_cache": True, "x": 1})
    where = strategy._checkpoint_path("memory://bucket/run/step-5", {"x": 2})
    assert isinstance(where, RemotePath) and str(where) == "memory://bucket/run/step-5"
    assert where.storage_options == {"skip_instance_cache": True, "x": 2}  # the call's options win
    assert strategy._checkpoint_path("memory://b/c").storage_options == {"skip_instance_cache": True, "x": 1}


def test_load_without_state_asks_for_one(tmp_path):
    with pytest.raises(ValueError, match=r"a state with at least one object to restore is needed"):
        ModelParallelStrategy(identity).load_checkpoint(tmp_path, state={})
