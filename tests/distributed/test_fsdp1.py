"""FSDP1 migration: checkpoints written by real FSDP1 load into FSDP2/TP models, and training goes on.

Spawn 1 (2 processes) trains with real torch FSDP1 and writes checkpoints in the layouts Lightning's
strategies write, with Lightning's own code wherever it runs on CPU:

* Fabric ``FSDPStrategy``, sharded: Lightning's ``save_checkpoint`` itself (DCP with ShardedTensors + meta.pt);
* Fabric full: FSDP1 ``FULL_STATE_DICT`` model + ``FSDP.optim_state_dict`` in Lightning's full layout;
* a raw FSDP1 ``FULL_STATE_DICT`` model file;
* Trainer ``FSDPStrategy``, sharded and full: real ``Trainer.fit`` runs with ``ModelCheckpoint``.

Lightning refuses ``FSDPStrategy`` on CPU by checking ``type(strategy) is FSDPStrategy``; the subclasses below
change nothing but that type. Lightning's full-state path offloads to CPU, which torch's FSDP1 supports only
on GPUs (it crashes on CPU), so the full variants make the same calls with ``offload_to_cpu=False``.

Spawn 2 (4 processes as two nodes) loads each into our strategies on other layouts (Fabric, standalone,
Trainer), compares weights and Adam moments with what FSDP1 held, and continues training against FSDP1's
own continuation (or the single-process reference, for the Trainer runs).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import FSDPStrategy as TrainerFSDPStrategy
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import (
    FSDPModule,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    StateDictType,
)
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from harness import PG_TIMEOUT, run_distributed
from modelpar import ModelParallelStrategy
from modelpar.checkpoint import (
    clean_name,
    convert_to_distributed,
    convert_to_file,
    load_state,
    optimizer_state_to_names,
    optimizer_state_to_positions,
)
from modelpar.models.llama import TransformerBlock
from modelpar.plans import parallelize_llama
from modelpar.trainer import ModelParallelStrategy as TrainerStrategy
from parity import adamw, full, global_batches, lm_loss, make_fabric, reference_model
from trainer_module import GLOBAL_BATCH, LlamaModule, loader, quiet_trainer, reference_run

LR = 1e-2
CPU = torch.device("cpu")


class CPUFabricFSDPStrategy(FabricFSDPStrategy):
    """Lightning's Fabric FSDPStrategy, unchanged; only its type differs, which lets Fabric run it on CPU. FSDP1 on
    CPU must be told its device (Lightning passes ``root_device.index``, None there), so the wrap Lightning would do
    is done here with ``device_id=CPU``, with Lightning's own arguments; Lightning's code does the rest (AC ...)."""

    def setup_module(self, module: torch.nn.Module) -> Any:
        if not any(isinstance(m, FSDP) for m in module.modules()):
            module = FSDP(
                module,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=CPU,
                **self._fsdp_kwargs,
            )
        return super().setup_module(module)


class CPUTrainerFSDPStrategy(TrainerFSDPStrategy):
    """Lightning's Trainer FSDPStrategy; for ``state_dict_type="full"`` the same calls without CPU offload."""

    def _full_context(self) -> Any:
        return FSDP.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),
        )

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._state_dict_type != "full":
            return super().lightning_module_state_dict()
        with self._full_context():
            return self.model.state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        with self._full_context():
            state = FSDP.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:
                state = FSDP.rekey_optim_state_dict(state, OptimStateKeyType.PARAM_ID, self.model)
            return state


def fsdp1_wrap(model: torch.nn.Module) -> FSDP:
    """FSDP1 per block, then the root, as an auto-wrap policy on the blocks would do."""
    for i, block in enumerate(model.layers):
        model.layers[i] = FSDP(block, device_id=CPU, use_orig_params=True)
    return FSDP(model, device_id=CPU, use_orig_params=True)


def fsdp1_full_state(model: FSDP, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    config = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    optim_config = FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config, optim_config):
        return model.state_dict(), FSDP.optim_state_dict(model, optimizer)


class FSDP1Module(LlamaModule):
    """The Trainer module, wrapped with FSDP1 in configure_model (Lightning then keeps the wrapping)."""

    def configure_model(self) -> None:
        if self.model is None:
            self.model = fsdp1_wrap(reference_model())


def _local(x: torch.Tensor) -> torch.Tensor:
    per = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * per : (dist.get_rank() + 1) * per]


#: The arguments of a script written for Lightning's ``FSDPStrategy``; the one-line switch changes only the class.
SCRIPT_ARGS: dict[str, Any] = {
    "auto_wrap_policy": {TransformerBlock},
    "activation_checkpointing_policy": {TransformerBlock},
    "state_dict_type": "sharded",
    "timeout": PG_TIMEOUT,
}
SHARDING = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def fsdp_strategy_script(fabric: Any, resume: Path | None, save: Path | None, steps: int) -> tuple[Any, list[float]]:
    """A training script written for Lightning's ``FSDPStrategy`` (Fabric): the strategy is its only variable."""
    model = fabric.setup_module(reference_model())
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    losses, batches = [], global_batches(steps)
    while state["step"] < steps:
        x, y = batches[state["step"]]
        per = x.shape[0] // fabric.world_size
        rows = slice(fabric.global_rank * per, (fabric.global_rank + 1) * per)
        loss = lm_loss(model(x[rows]), y[rows])
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
        state["step"] += 1
        if save is not None and state["step"] == 2:
            fabric.save(save, state)
    return model, losses


class FSDP1StyleModule(LlamaModule):
    """A LightningModule written for Lightning's ``FSDPStrategy``: ``configure_model`` builds, the strategy wraps."""

    def configure_model(self) -> None:
        if self.model is None:
            self.model = reference_model()


# ---------------------------------------------------------------------------------------------------
# spawn 1: write with FSDP1
# ---------------------------------------------------------------------------------------------------
def write_fsdp1_checkpoints(root: Path) -> dict[str, Any]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUFabricFSDPStrategy(state_dict_type="sharded"))
    fabric.launch()
    model = fabric.setup_module(fsdp1_wrap(reference_model()))
    optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
    for x, y in global_batches(2):
        fabric.backward(lm_loss(model(_local(x)), _local(y)))
        optimizer.step()
        optimizer.zero_grad()
    fabric.save(root / "fabric-sharded", {"model": model, "optimizer": optimizer, "step": 2})  # Lightning's code
    fsdp_model = model.module
    sd, osd = fsdp1_full_state(fsdp_model, optimizer.optimizer)
    out: dict[str, Any] = {"rekey": _rekey_fsdp1(fsdp_model, optimizer.optimizer, osd)}
    if dist.get_rank() == 0:
        torch.save({"model": sd, "optimizer": osd, "step": 2}, root / "fabric-full.ckpt")  # Lightning's full layout
        torch.save(sd, root / "fsdp1-raw.pt")
        torch.save({"model": sd, "moments": osd["state"]}, root / "truth.pt")
    x, y = global_batches(3)[2]  # FSDP1 goes on: the loss and weights our strategies must reproduce
    loss = lm_loss(model(_local(x)), _local(y))
    fabric.backward(loss)
    optimizer.step()
    global_loss = loss.detach().clone()
    dist.all_reduce(global_loss)
    sd_next, _ = fsdp1_full_state(fsdp_model, optimizer.optimizer)
    if dist.get_rank() == 0:
        torch.save({"loss": global_loss.item() / 2, "model": sd_next}, root / "truth-next.pt")
    # the script, with Lightning's own FSDPStrategy: writes at step 2, goes on to step 3 (the truth for the switch)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=CPUFabricFSDPStrategy(**SCRIPT_ARGS))
    fabric.launch()
    model, losses = fsdp_strategy_script(fabric, None, root / "script-fsdp1", steps=3)
    # `model.module` is the model as given; the FSDP1 root Lightning wrapped it in is the forward module
    script_sd = get_model_state_dict(model._forward_module, options=StateDictOptions(full_state_dict=True))
    if dist.get_rank() == 0:
        torch.save({"loss": losses[-1], "model": script_sd}, root / "truth-script.pt")
    out["detect"] = _fsdp1_models_are_refused()
    for kind in ("sharded", "full"):
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=2,
            max_epochs=1,
            strategy=CPUTrainerFSDPStrategy(state_dict_type=kind, timeout=PG_TIMEOUT),
            callbacks=[ModelCheckpoint(dirpath=root / f"trainer-{kind}")],
        )
        trainer.fit(FSDP1Module(), loader(GLOBAL_BATCH // 2))
    dist.barrier()
    return out


def _rekey_fsdp1(model: FSDP, optimizer: torch.optim.Optimizer, full_osd: dict[str, Any]) -> bool:
    """Re-keying needs no FSDP1 object: names from our mapping equal FSDP1's own, and round-trip."""
    local = optimizer.state_dict()
    by_name = optimizer_state_to_names(local, model, optimizer)
    # A rank's local state only has parameters with elements in its shard; the groups list all of them.
    grouped = {name for group in by_name["param_groups"] for name in group["params"]}
    assert grouped == set(full_osd["state"]) and set(by_name["state"]) <= grouped
    back = optimizer_state_to_positions(by_name, model, optimizer)
    torch.testing.assert_close(back["state"], local["state"], atol=0, rtol=0)
    return True


def _fsdp1_models_are_refused() -> dict[str, str]:
    messages = {}
    wrapped = fsdp1_wrap(reference_model())
    fabric = make_fabric(2, 1, world_size=2)
    with pytest.raises(
        TypeError, match=r"wrapped with FSDP1 .*'<root>', 'layers\.0', 'layers\.1'.*migrating-from-fsdp1"
    ):
        fabric.setup_module(wrapped)
    standalone = ModelParallelStrategy(parallelize_llama, 2, 1, timeout=PG_TIMEOUT)
    with pytest.raises(TypeError, match=r"wrapped with FSDP1"):  # first, as Lightning: before the environment too
        standalone.setup_module(wrapped)
    standalone.setup_environment()
    with pytest.raises(TypeError, match=r"wrapped with FSDP1") as e:
        standalone.setup_module(fsdp1_wrap(reference_model()))
    messages["standalone"] = str(e.value)
    trainer = quiet_trainer(
        accelerator="cpu",
        devices=2,
        max_steps=1,
        strategy=TrainerStrategy(2, 1, timeout=PG_TIMEOUT),
    )
    with pytest.raises(TypeError, match=r"wrapped with FSDP1 .*'model', 'model\.layers\.0'") as e2:
        trainer.fit(FSDP1Module(), loader(GLOBAL_BATCH // 2))
    messages["trainer"] = str(e2.value)
    return messages


# ---------------------------------------------------------------------------------------------------
# spawn 2: load into FSDP2 / TP
# ---------------------------------------------------------------------------------------------------
def _assert_truth(model: Any, optimizer: Any, truth: dict[str, Any], where: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    got = {k: full(v) for k, v in getattr(model, "module", model).state_dict().items()}
    torch.testing.assert_close(got, truth["model"], atol=0, rtol=0, msg=lambda m: f"{where} weights: {m}")
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)
        moments = get_optimizer_state_dict(
            getattr(model, "module", model), inner, options=StateDictOptions(full_state_dict=True)
        )
        torch.testing.assert_close(
            moments["state"], truth["moments"], atol=0, rtol=0, msg=lambda m: f"{where} Adam: {m}"
        )


def _continue_like_fsdp1(fabric: Any, model: Any, optimizer: Any, truth_next: dict[str, Any], where: str) -> float:
    x, y = global_batches(3)[2]
    from parity import local_slice

    loss = lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y))
    fabric.backward(loss)
    optimizer.step()
    got_loss = fabric.all_reduce(loss.detach().clone()).item()
    assert abs(got_loss - truth_next["loss"]) < 1e-5, (where, got_loss, truth_next["loss"])
    got = {k: full(v) for k, v in model.module.state_dict().items()}
    torch.testing.assert_close(
        got, truth_next["model"], atol=2e-5, rtol=1e-4, msg=lambda m: f"{where} after a step: {m}"
    )
    return got_loss


def load_into_fsdp2_tp(root: Path) -> dict[str, Any]:
    truth = torch.load(root / "truth.pt", weights_only=True)
    truth_next = torch.load(root / "truth-next.pt", weights_only=True)
    out: dict[str, Any] = {}
    for layout, source in (((2, 2), "fabric-sharded"), ((1, 4), "fabric-full.ckpt"), ((4, 1), "fabric-sharded")):
        fabric = make_fabric(*layout, world_size=4, num_nodes=2)
        model = fabric.setup_module(reference_model(seed=5))
        optimizer = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(root / source, state)
        assert state["step"] == 2
        where = f"{source} -> {layout[0]}x{layout[1]}"
        _assert_truth(model, optimizer, truth, where)
        out[where] = _continue_like_fsdp1(fabric, model, optimizer, truth_next, where)
    # raw FSDP1 model file with load_raw, and standalone use of the strategy
    fabric = make_fabric(2, 2, world_size=4, num_nodes=2)
    model = fabric.setup_module(reference_model(seed=5))
    fabric.load_raw(root / "fsdp1-raw.pt", model)
    _assert_truth(model, None, truth, "raw FSDP1 file -> 2x2")
    standalone = ModelParallelStrategy(parallelize_llama, 1, 4, timeout=PG_TIMEOUT)
    standalone.setup_environment()
    smodel = standalone.setup_module(reference_model(seed=5))
    sopt = adamw(smodel.parameters(), lr=LR)
    standalone.load_checkpoint(root / "fabric-sharded", {"model": smodel, "optimizer": sopt})
    _assert_truth(smodel, sopt, truth, "fabric-sharded -> standalone 1x4")
    # the Trainer resumes FSDP1 Trainer checkpoints on other layouts and matches the reference
    for kind, layout in (("sharded", (2, 2)), ("full", (1, 4))):
        trainer = quiet_trainer(
            accelerator="cpu",
            devices=2,
            num_nodes=2,
            max_epochs=3,
            strategy=TrainerStrategy(*layout, timeout=PG_TIMEOUT),
        )
        module = LlamaModule()
        trainer.fit(
            module, loader(GLOBAL_BATCH // layout[0]), ckpt_path=root / f"trainer-{kind}" / "epoch=0-step=1.ckpt"
        )
        got = {k: full(v) for k, v in module.model.state_dict().items()}
        torch.testing.assert_close(got, reference_run(3)[0].state_dict(), atol=2e-5, rtol=1e-4)
        out[f"trainer-{kind}"] = trainer.global_step
    # the same script with only the class changed, for each sharding strategy, resumes Lightning FSDP1's checkpoint
    truth_script = torch.load(root / "truth-script.pt", weights_only=True)
    for sharding in SHARDING:
        strategy = ModelParallelStrategy(**SCRIPT_ARGS, sharding_strategy=sharding)
        fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2, strategy=strategy)
        fabric.launch()
        model, losses = fsdp_strategy_script(fabric, root / "script-fsdp1", None, steps=3)
        assert abs(losses[-1] - truth_script["loss"]) < 1e-5, (sharding, losses, truth_script["loss"])
        got = {k: full(v) for k, v in model.module.state_dict().items()}
        torch.testing.assert_close(
            got, truth_script["model"], atol=2e-5, rtol=1e-4, msg=lambda m, s=sharding: f"{s}: {m}"
        )
        units = [n for n, m in model.module.named_modules() if n and isinstance(m, FSDPModule)]
        options = strategy._core.options
        out[f"script-{sharding}"] = (
            tuple(strategy.device_mesh.shape),
            units,
            (options.reshard_after_forward, options.save_distributed_checkpoint),
        )
    for sharding in SHARDING:
        strategy = TrainerStrategy(**SCRIPT_ARGS, sharding_strategy=sharding)
        trainer = quiet_trainer(accelerator="cpu", devices=2, num_nodes=2, max_epochs=3, strategy=strategy)
        module = FSDP1StyleModule()
        trainer.fit(module, loader(GLOBAL_BATCH // 4), ckpt_path=root / "trainer-sharded" / "epoch=0-step=1.ckpt")
        got = {k: full(v) for k, v in module.model.state_dict().items()}
        torch.testing.assert_close(got, reference_run(3)[0].state_dict(), atol=2e-5, rtol=1e-4)
        out[f"trainer-script-{sharding}"] = (trainer.global_step, tuple(strategy.device_mesh.shape))
    # re-keying a FSDP2/TP optimizer's own state dict
    by_name = optimizer_state_to_names(sopt.state_dict(), smodel, sopt)
    assert set(by_name["state"]) == {clean_name(n) for n, _ in smodel.named_parameters()}
    torch.testing.assert_close(optimizer_state_to_positions(by_name, smodel, sopt)["state"], sopt.state_dict()["state"])
    return out


@pytest.fixture(scope="module")
def fsdp1(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("fsdp1")
    written = run_distributed(write_fsdp1_checkpoints, 2, root)
    loaded = run_distributed(load_into_fsdp2_tp, 4, root, nodes=2)
    return {"root": root, "written": written, "loaded": loaded}


def test_fsdp1_wrapped_models_are_refused_naming_the_wrapped_modules_everywhere(fsdp1):
    messages = fsdp1["written"][0]["detect"]
    assert "'<root>'" in messages["standalone"] and "migrating-from-fsdp1" in messages["trainer"]


def test_optimizer_rekeying_needs_no_fsdp1_object(fsdp1):
    assert all(r["rekey"] for r in fsdp1["written"])


def test_fabric_fsdp1_checkpoints_load_on_other_layouts_and_training_continues_with_the_same_loss(fsdp1):
    results = fsdp1["loaded"][0]
    for where in ("fabric-sharded -> 2x2", "fabric-full.ckpt -> 1x4", "fabric-sharded -> 4x1"):
        assert where in results


def test_a_script_for_lightnings_fsdp_strategy_runs_with_only_the_class_changed_for_each_sharding_strategy(fsdp1):
    """Resuming the checkpoint Lightning's FSDPStrategy wrote, step 3 gives FSDP1's own loss and weights."""
    results = fsdp1["loaded"][0]
    meshes = {s: results[f"script-{s}"][0] for s in SHARDING}
    assert meshes == {
        "FULL_SHARD": (4, 1),
        "SHARD_GRAD_OP": (4, 1),
        "HYBRID_SHARD": (2, 2, 1),
        "_HYBRID_SHARD_ZERO2": (2, 2, 1),
    }
    for sharding in SHARDING:
        _, units, (reshard_after_forward, distributed_checkpoint) = results[f"script-{sharding}"]
        assert units == ["layers.0", "layers.1"]
        assert reshard_after_forward is (False if "ZERO2" in sharding or "GRAD_OP" in sharding else None)
        assert distributed_checkpoint is True
    assert {s: results[f"trainer-script-{s}"] for s in SHARDING} == {s: (3, meshes[s]) for s in SHARDING}


def test_the_fsdp1_script_run_the_switch_is_held_to_reproduces_the_single_process_reference(fsdp1):
    """The truth the one-line switch is compared with (FSDP1's step 3) is itself one process's step 3."""
    truth = torch.load(fsdp1["root"] / "truth-script.pt", weights_only=True)
    ref = reference_model()
    opt = adamw(ref.parameters(), lr=LR)
    for x, y in global_batches(3):
        loss = lm_loss(ref(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert abs(loss.item() - truth["loss"]) < 1e-5
    torch.testing.assert_close(truth["model"], ref.state_dict(), atol=2e-5, rtol=1e-4)


def test_trainer_fsdp1_checkpoints_resume_on_other_layouts_like_the_reference(fsdp1):
    assert fsdp1["loaded"][0]["trainer-sharded"] == 3 and fsdp1["loaded"][0]["trainer-full"] == 3


def test_fsdp1_checkpoints_convert_offline_to_our_formats(fsdp1, tmp_path):
    root = fsdp1["root"]
    truth = torch.load(root / "truth.pt", weights_only=True)
    convert_to_file(root / "fabric-sharded", tmp_path / "from-sharded.pt", progress=False)
    convert_to_distributed(root / "fabric-full.ckpt", tmp_path / "from-full", progress=False)
    for src in (tmp_path / "from-sharded.pt", tmp_path / "from-full"):
        model = reference_model(seed=5)
        opt = adamw(model.parameters(), lr=LR)
        state = {"model": model, "optimizer": opt, "step": 0}
        load_state(src, state)
        assert state["step"] == 2
        _assert_truth(model, opt, truth, f"converted {src.name}")
    convert_to_file(root / "trainer-sharded" / "epoch=0-step=1.ckpt", tmp_path / "trainer.ckpt", progress=False)
    converted = torch.load(tmp_path / "trainer.ckpt", weights_only=False)
    assert {"model", "optimizer_0", "global_step"} <= set(converted)  # the folder's own keys
    assert "model.layers.0.attention.wq.weight" in converted["model"]
    # ... and the Trainer-layout loader takes it: model, optimizer and the Trainer's state
    from modelpar.checkpoint import Checkpointer

    module = LlamaModule(build_in_init=True)
    opt = adamw(module.parameters(), lr=LR)
    rest = Checkpointer().load_trainer_checkpoint(tmp_path / "trainer.ckpt", module, [opt], weights_only=False)
    assert rest["global_step"] == 1 and "loops" in rest
    torch.testing.assert_close(module.model.state_dict(), reference_run(1)[0].state_dict(), atol=2e-5, rtol=1e-4)
    assert all(s["step"] == 1 for s in opt.state.values()) and len(opt.state) == 21


def test_a_fsdp1_run_reproduces_the_single_process_reference(fsdp1):
    truth = torch.load(fsdp1["root"] / "truth.pt", weights_only=True)
    ref = reference_model()
    opt = adamw(ref.parameters(), lr=LR)
    for x, y in global_batches(2):
        lm_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(truth["model"], ref.state_dict(), atol=2e-5, rtol=1e-4)
