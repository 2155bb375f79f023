"""The Trainer adapter without processes: the optional extra, construction, Lightning's checks."""

import subprocess
import sys

import pytest

pl = pytest.importorskip("pytorch_lightning")

from modelpar.trainer import ModelParallelStrategy  # noqa: E402


def test_without_the_trainer_extra_the_import_error_names_it():
    code = "import sys; sys.modules['pytorch_lightning'] = sys.modules['lightning'] = None; import modelpar.trainer"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert (
        "ImportError" in result.stderr
        and "pip install 'modelpar[trainer]'` or `pip install lightning`" in result.stderr
    )


def test_fp16_mixed_is_refused_by_the_trainer_as_for_lightnings_strategy():
    with pytest.raises(ValueError, match=r"does not support .*16-mixed"):
        pl.Trainer(strategy=ModelParallelStrategy(), precision="16-mixed", devices=1, logger=False)


def test_sizes_and_parallelize_fn_are_validated_at_construction():
    with pytest.raises(ValueError, match=r"`tensor_parallel_size=0` is not a valid size"):
        ModelParallelStrategy(tensor_parallel_size=0)
    with pytest.raises(TypeError, match=r"must be a callable `\(model, device_mesh\) -> model`, but got str"):
        ModelParallelStrategy(parallelize_fn="fsdp")  # type: ignore[arg-type]


def test_lightning_sees_a_distributed_model_parallel_strategy():
    from pytorch_lightning.strategies import ModelParallelStrategy as LightningStrategy

    strategy = ModelParallelStrategy()
    assert isinstance(strategy, LightningStrategy)
    assert strategy.restore_checkpoint_after_setup and not strategy.lightning_restore_optimizer
    with pytest.raises(RuntimeError, match=r"Accessing the device mesh before it exists is not allowed"):
        strategy.device_mesh
