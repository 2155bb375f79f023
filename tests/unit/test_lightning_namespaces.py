"""Both Lightning namespaces (``lightning.fabric`` / ``lightning.pytorch`` and the standalone packages) accept
the strategies, check precisions the same way, and point a strategy handed to the wrong framework to the
right import. The distributed Fabric and Trainer suites run their 2-process grids, which hold every kind of case, under
both namespaces, and their 4-process grids under one."""

import importlib
import subprocess
import sys

import pytest

from modelpar import ModelParallelStrategy
from modelpar.trainer import ModelParallelStrategy as TrainerStrategy

FABRICS = ["lightning_fabric", "lightning.fabric"]
TRAINERS = ["pytorch_lightning", "lightning.pytorch"]


def identity(model, mesh):
    return model


@pytest.mark.parametrize("namespace", FABRICS)
def test_fabric_of_either_namespace_accepts_the_strategy_and_uses_its_own_launcher(namespace):
    fabric_module = importlib.import_module(namespace)
    strategies = importlib.import_module(f"{namespace}.strategies")
    strategy = ModelParallelStrategy(identity)
    assert isinstance(strategy, strategies.ModelParallelStrategy) and isinstance(strategy, strategies.Strategy)
    fabric = fabric_module.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    assert fabric.strategy is strategy
    assert type(strategy.launcher).__module__.startswith(f"{namespace}.strategies.launchers")


@pytest.mark.parametrize("namespace", FABRICS)
def test_unsupported_precisions_are_refused_by_fabric_of_either_namespace(namespace):
    fabric_module = importlib.import_module(namespace)
    with pytest.raises(ValueError, match=r"does not support .*16-mixed"):
        fabric_module.Fabric(
            accelerator="cpu", devices=1, strategy=ModelParallelStrategy(identity), precision="16-mixed"
        )
    with pytest.raises(ValueError, match=r"does not support .*64-true"):
        fabric_module.Fabric(
            accelerator="cpu", devices=1, strategy=ModelParallelStrategy(identity), precision="64-true"
        )
    plugins = importlib.import_module(f"{namespace}.plugins")
    for precision in (
        plugins.Precision(),
        plugins.MixedPrecision("bf16-mixed", "cpu"),
        plugins.HalfPrecision("bf16-true"),
    ):
        assert ModelParallelStrategy(identity, precision=precision).precision is precision


@pytest.mark.parametrize("namespace", TRAINERS)
def test_trainer_of_either_namespace_accepts_the_strategy_and_uses_its_own_launcher(namespace):
    pl = importlib.import_module(namespace)
    strategy = TrainerStrategy()
    assert isinstance(strategy, importlib.import_module(f"{namespace}.strategies").ModelParallelStrategy)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False)
    assert trainer.strategy is strategy
    assert type(strategy.launcher).__module__.startswith(f"{namespace}.strategies.launchers")
    with pytest.raises(ValueError, match=r"does not support .*16-mixed"):
        pl.Trainer(strategy=TrainerStrategy(), precision="16-mixed", devices=1, logger=False)


@pytest.mark.parametrize("namespace", TRAINERS)
def test_the_fabric_strategy_given_to_a_trainer_names_the_trainer_import(namespace):
    pl = importlib.import_module(namespace)
    with pytest.raises(
        ValueError, match=r"invalid strategy.*use `from modelpar\.trainer import ModelParallelStrategy`"
    ):
        pl.Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(identity), logger=False)


@pytest.mark.parametrize("namespace", FABRICS)
def test_the_trainer_strategy_given_to_fabric_names_the_fabric_import(namespace):
    fabric_module = importlib.import_module(namespace)
    with pytest.raises(ValueError, match=r"invalid strategy.*use `from modelpar import ModelParallelStrategy`"):
        fabric_module.Fabric(accelerator="cpu", devices=1, strategy=TrainerStrategy())


def test_without_the_unified_package_the_standalone_packages_are_enough():
    code = (
        "import sys; sys.modules['lightning'] = None\n"
        "import lightning_fabric, modelpar, modelpar.trainer, pytorch_lightning\n"
        "s = modelpar.ModelParallelStrategy(lambda m, d: m)\n"
        "f = lightning_fabric.Fabric(accelerator='cpu', devices=1, strategy=s)\n"
        "t = pytorch_lightning.Trainer(accelerator='cpu', devices=1, strategy=modelpar.trainer.ModelParallelStrategy(), logger=False)\n"
        "print('ok', 'lightning' in sys.modules and sys.modules['lightning'] is not None)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[-2:] == ["ok", "False"]
