"""The Trainer strategy on real gloo process groups, every training run checked against a reference.

Per Lightning namespace (``pytorch_lightning`` and ``lightning.pytorch``), spawn 1: 2 processes (meshes 2x1
and 1x2): fit / validate / test / predict, accumulation, clipping, `sync_dist`, precisions, CPU offload, one Trainer
re-running fit / validate / test / predict / fit on one module, and ``save_checkpoint`` into existing folders. Spawn 2,
in one namespace (:data:`FOUR_NAMESPACE`): 4 processes as two nodes: 2x2 fit, checkpoints in both formats through
ModelCheckpoint, resuming on another layout, and checkpoints written by Lightning's own strategy. Single-device
Trainer runs in the test process check the interchange with non-sharded runs.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from harness import PG_TIMEOUT, run_distributed
from modelpar.trainer import ModelParallelStrategy
from trainer_module import (
    GAMMA,
    GLOBAL_BATCH,
    LR,
    TRAINER_NAMESPACES,
    lightning,
    loader,
    namespace_of,
    parallelize_lightning_module,
    quiet_trainer,
    reference_run,
    use_namespace,
)


def full_weights(module: Any) -> dict[str, torch.Tensor]:
    sd = get_model_state_dict(module.model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().clone() for k, v in sd.items()}


def assert_weights(module: Any, ref: torch.nn.Module, what: str, atol: float = 2e-5) -> None:
    got = full_weights(module)
    torch.testing.assert_close(got, ref.state_dict(), atol=atol, rtol=1e-4, msg=lambda m: f"{what}: {m}")


def trainer(dp: Any, tp: Any, world: int, nodes: int = 1, **kwargs: Any) -> Any:
    own = (
        "save_distributed_checkpoint",
        "parallelize_fn",
        "gradient_accumulation",
        "data_parallel_replicate_size",
        "cpu_offload",
    )
    strategy_kwargs = {k: kwargs.pop(k) for k in own if k in kwargs}
    strategy = ModelParallelStrategy(dp, tp, timeout=PG_TIMEOUT, **strategy_kwargs)
    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": world // nodes,
        "num_nodes": nodes,
        "strategy": strategy,
        "enable_checkpointing": False,
    }
    t = quiet_trainer(**{**defaults, **kwargs})
    assert type(t).__module__.startswith(lightning().name)
    return t


def per_rank(dp: int) -> int:
    """Per-rank batch size: the global batch split over the data-parallel ranks."""
    return GLOBAL_BATCH // dp


# ---------------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------------
def case_fit_validate_test_predict(dp: int, tp: int, world: int, nodes: int = 1) -> dict[str, Any]:
    t = trainer(dp, tp, world, nodes, max_steps=4, gradient_clip_val=0.05)
    module = lightning().LlamaModule()
    t.fit(module, loader(per_rank(dp)))
    assert_weights(module, reference_run(4, clip_norm=0.05)[0], f"fit {dp}x{tp} (clip by norm)")
    out: dict[str, Any] = {"mesh": tuple(t.strategy.device_mesh.shape)}
    val = t.validate(module, loader(per_rank(dp)), verbose=False)[0]
    test = t.test(module, loader(per_rank(dp)), verbose=False)[0]
    ref = reference_run(4, clip_norm=0.05)[0]
    from parity import global_batches, lm_loss

    with torch.no_grad():
        want = lm_loss(*[ref(global_batches(1)[0][0]), global_batches(1)[0][1]]).item()
    assert abs(val["val_loss"] - want) < 1e-4 and abs(test["test_loss"] - want) < 1e-4, (val, test, want)
    out["dp_rank_sum"] = val["dp_rank_plus_one"]  # logged with reduce_fx="sum": one count per DP rank
    preds = t.predict(module, loader(per_rank(dp)))
    x0 = loader(per_rank(dp)).dataset.tensors[0]
    rank = t.strategy.distributed_sampler_kwargs["rank"]
    n = t.strategy.distributed_sampler_kwargs["num_replicas"]
    with torch.no_grad():
        want_pred = ref(x0[rank::n][: per_rank(dp)]).argmax(-1)
    assert torch.equal(preds[0], want_pred)
    with torch.inference_mode():  # what the Trainer uses for evaluation on NCCL; gloo makes it use no_grad
        torch.testing.assert_close(module.model(x0[:2]), ref(x0[:2]), atol=2e-5, rtol=1e-4)
    return out


def case_accumulation_skips_reduction(dp: int, tp: int, world: int, mode: str) -> list[bool]:
    t = trainer(
        dp,
        tp,
        world,
        gradient_accumulation=mode,
        max_steps=2,
        accumulate_grad_batches=2,
        gradient_clip_val=0.02,
        gradient_clip_algorithm="value",
        parallelize_fn=parallelize_lightning_module,
    )
    module = lightning().LlamaModule(build_in_init=True)
    module.configure_model = lambda: None  # type: ignore[method-assign]  # the strategy's parallelize_fn does it
    t.fit(module, loader(per_rank(dp), micro_batches=2))
    assert_weights(module, reference_run(2, accumulate=2, clip_value=0.02)[0], f"accumulate {dp}x{tp} {mode}")
    return module.grad_none_after_backward


def reference_fits(init: dict[str, torch.Tensor], *steps: int) -> torch.nn.Module:
    """``reference_run`` from the weights ``init``, over several ``fit`` calls: each creates a new AdamW and StepLR."""
    from parity import adamw, global_batches, lm_loss, reference_model

    model = reference_model()
    model.load_state_dict(init)
    x, y = global_batches(1)[0]
    for n in steps:
        optimizer = adamw(model.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
        for _ in range(n):
            lm_loss(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
    return model


def case_rerun_fit_validate_test_predict_fit(dp: int, tp: int, world: int, parallelize_fn: bool) -> dict[str, Any]:
    """One module built on the meta device, one Trainer: fit, validate, test, predict, then fit on."""
    from parity import global_batches, lm_loss, reference_model

    how = "parallelize_fn" if parallelize_fn else "configure_model"
    if parallelize_fn:
        t = trainer(dp, tp, world, max_steps=2, parallelize_fn=parallelize_lightning_module)
        with t.init_module(empty_init=True):
            module = lightning().LlamaModule(build_in_init=True)
        module.configure_model = lambda: None  # type: ignore[method-assign]  # the strategy's parallelize_fn does it
    else:
        t = trainer(dp, tp, world, max_steps=2)
        module = lightning().LlamaModule()
        with torch.device("meta"):
            module.model = reference_model()  # configure_model parallelizes it; the strategy materializes it
    assert module.model.output.weight.is_meta
    init: dict[str, torch.Tensor] = {}

    def keep_initial_weights() -> None:  # materialized ones: meta-device init draws differently from eager init
        if not init:
            init.update(full_weights(module))

    module.on_fit_start = keep_initial_weights  # type: ignore[method-assign]
    data = loader(per_rank(dp))
    t.fit(module, data)
    mesh, first_optimizer = t.strategy.device_mesh, t.optimizers[0]
    ref = reference_fits(init, 2)
    assert_weights(module, ref, f"first fit {dp}x{tp} ({how})")
    with torch.device("meta"):
        module.probe = torch.nn.Linear(2, 2)  # a new layer: the next set-up materializes it and nothing else
    val = t.validate(module, data, verbose=False)[0]
    assert not module.probe.weight.is_meta
    assert_weights(module, ref, f"after validate {dp}x{tp} ({how})")  # not parallelized or initialized again
    test = t.test(module, data, verbose=False)[0]
    preds = t.predict(module, data)
    x, y = global_batches(1)[0]
    sampler = t.strategy.distributed_sampler_kwargs
    with torch.no_grad():
        want = lm_loss(ref(x), y).item()
        want_pred = ref(x[sampler["rank"] :: sampler["num_replicas"]]).argmax(-1)
    assert abs(val["val_loss"] - want) < 1e-4 and abs(test["test_loss"] - want) < 1e-4, (val, test, want)
    assert torch.equal(preds[0], want_pred)
    t.fit_loop.epoch_loop.max_steps = 4  # two more steps
    t.fit(module, data)  # from the trained weights, with a new optimizer and scheduler
    # A fresh AdamW's first steps are about lr * sign(grad): rounding noise in small gradients grows ~100x
    # (two single-process runs that only split the batch differently differ by 1e-4 here). A re-initialized
    # model, a lost step or a scheduler not re-created differs by 1e-2 or more.
    assert_weights(module, reference_fits(init, 2, 2), f"second fit {dp}x{tp} ({how})", atol=3e-4)
    optimizer = t.optimizers[0]
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    out = {
        "mesh_reused": t.strategy.device_mesh is mesh and module.device_mesh is mesh,
        "optimizer_recreated": optimizer is not first_optimizer and optimized == {id(p) for p in module.parameters()},
        "global_step": t.global_step,
    }
    # Another Trainer on the same layout runs the module as it is; on another layout it refuses it.
    strategy_kwargs = {"parallelize_fn": parallelize_lightning_module} if parallelize_fn else {}
    trainer(dp, tp, world, **strategy_kwargs).validate(module, data, verbose=False)
    assert_weights(module, reference_fits(init, 2, 2), f"new Trainer {dp}x{tp} ({how})", atol=3e-4)
    with pytest.raises(ValueError, match=rf"set up on a {dp}x{tp} cpu mesh .* this strategy's mesh is a {tp}x{dp}"):
        trainer(tp, dp, world, **strategy_kwargs).validate(module, data, verbose=False)
    return out


def case_checkpoints_and_resume(root: Path, distributed: bool) -> dict[str, Any]:
    L = lightning()
    ModelCheckpoint, CountingCallback, LlamaModule = L.ModelCheckpoint, L.CountingCallback, L.LlamaModule
    tag = "dist" if distributed else "full"
    ckpt_dir = root / f"trainer-{tag}"
    every_epoch = ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_epochs=1, save_last=True)
    best = ModelCheckpoint(dirpath=ckpt_dir / "best", monitor="train_loss", mode="min", save_top_k=1)
    weights = ModelCheckpoint(dirpath=ckpt_dir / "weights", save_weights_only=True, every_n_train_steps=3)
    t = trainer(
        2,
        2,
        4,
        2,
        max_epochs=3,
        enable_checkpointing=True,
        save_distributed_checkpoint=distributed,
        callbacks=[every_epoch, best, weights, CountingCallback()],
    )
    module = LlamaModule()
    t.fit(module, loader(per_rank(2)))
    final = full_weights(module)
    assert_weights(module, reference_run(3)[0], f"2x2 fit with checkpoints ({tag})")
    names = sorted(p.name for p in ckpt_dir.iterdir())
    # resume from the end of epoch 0 on another layout: model, optimizer, scheduler, loops, callbacks
    counter = CountingCallback()
    t2 = trainer(1, 4, 4, 2, max_epochs=3, save_distributed_checkpoint=distributed, callbacks=[counter])
    module2 = LlamaModule()
    t2.fit(module2, loader(per_rank(1)), ckpt_path=ckpt_dir / "epoch=0-step=1.ckpt")
    assert t2.global_step == 3 and counter.batches == 3, (t2.global_step, counter.batches)
    torch.testing.assert_close(full_weights(module2), final, atol=2e-5, rtol=1e-4)
    # weights-only checkpoints evaluate, and refuse to resume training with a clear message
    weights_ckpt = next((ckpt_dir / "weights").iterdir())
    t3 = trainer(2, 2, 4, 2, save_distributed_checkpoint=distributed)
    module3 = LlamaModule()
    t3.validate(module3, loader(per_rank(2)), ckpt_path=weights_ckpt, verbose=False)
    torch.testing.assert_close(full_weights(module3), final, atol=0, rtol=0)
    t4 = trainer(2, 2, 4, 2, max_epochs=4, save_distributed_checkpoint=distributed)
    with pytest.raises(KeyError, match=r"(optimizer|holds only the model)"):
        t4.fit(LlamaModule(), loader(per_rank(2)), ckpt_path=weights_ckpt)
    return {"files": names, "best": sorted(p.name for p in (ckpt_dir / "best").iterdir())}


def case_lightning_checkpoints_load_into_ours(root: Path, distributed: bool) -> bool:
    L = lightning()
    LightningStrategy, ModelCheckpoint, LlamaModule = L.LightningModelParallelStrategy, L.ModelCheckpoint, L.LlamaModule
    tag = "dist" if distributed else "full"
    theirs = quiet_trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        max_epochs=1,
        strategy=LightningStrategy(2, 2, save_distributed_checkpoint=distributed, timeout=PG_TIMEOUT),
        callbacks=[ModelCheckpoint(dirpath=root / f"lightning-{tag}", save_top_k=-1)],
    )
    theirs.fit(LlamaModule(), loader(GLOBAL_BATCH // 2))
    t = trainer(2, 2, 4, 2, max_epochs=3, save_distributed_checkpoint=distributed)
    module = LlamaModule()
    t.fit(module, loader(per_rank(2)), ckpt_path=root / f"lightning-{tag}" / "epoch=0-step=1.ckpt")
    assert_weights(module, reference_run(3)[0], f"Lightning ({tag}) -> modelpar resume")
    return True


def case_single_device_interchange(root: Path) -> bool:
    """A single-device checkpoint resumes here (2x2), and ours is written for single-device runs to resume."""
    ModelCheckpoint, LlamaModule = lightning().ModelCheckpoint, lightning().LlamaModule
    t = trainer(
        2,
        2,
        4,
        2,
        max_epochs=3,
        save_distributed_checkpoint=False,
        callbacks=[ModelCheckpoint(dirpath=root / "from-modelpar-full", save_top_k=-1)],
        enable_checkpointing=True,
    )
    module = LlamaModule()
    t.fit(module, loader(per_rank(2)), ckpt_path=root / "single-device" / "epoch=0-step=1.ckpt")
    assert_weights(module, reference_run(3)[0], "single device -> modelpar resume")
    return True


def _returns_another_module(module: Any, mesh: Any) -> Any:
    return torch.nn.Linear(4, 4)


def case_setup_errors() -> dict[str, str]:
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=2)
    PlainModule = lightning().PlainModule
    messages = {}
    # Neither `configure_model` nor `parallelize_fn`: the strategy shards the module itself (FSDP2, no code); this
    # one has no repeated blocks, so it is one unit, with the warning that says what that costs.
    plain = PlainModule()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(2, 1, 2, max_steps=1).fit(plain, data)
    messages["neither"] = f"sharded: {isinstance(plain.layer.weight, DTensor)}"
    messages["neither_warning"] = str(any("no repeated blocks in PlainModule" in str(w.message) for w in caught))
    with pytest.raises(TypeError, match=r"must parallelize the LightningModule in place .* different Linear") as e2:
        trainer(2, 1, 2, max_steps=1, parallelize_fn=_returns_another_module).fit(PlainModule(), data)
    messages["other_module"] = str(e2.value)
    return messages


_DTYPES = {"bf16-mixed": torch.float32, "bf16-true": torch.bfloat16, "16-true": torch.float16}


def case_precision(precision: str) -> dict[str, Any]:
    """One step in ``precision`` on 1x2 against the same step on one process in the same precision."""
    from parity import global_batches, lm_loss, reference_model

    t = trainer(1, 2, 2, max_steps=1, precision=precision)
    module = lightning().SGDModule()
    t.fit(module, loader(GLOBAL_BATCH))
    dtype = _DTYPES[precision]
    # The Trainer builds the model under the precision's default dtype, and initializing in bf16 draws other
    # values than initializing in fp32 and casting: build the reference the same way.
    torch.set_default_dtype(dtype)
    try:
        ref = reference_model()
    finally:
        torch.set_default_dtype(torch.float32)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x, y = global_batches(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        loss = lm_loss(ref(x), y)
    loss.backward()
    opt.step()
    got = full_weights(module)
    assert {v.dtype for v in got.values()} == {dtype}
    torch.testing.assert_close(got, ref.state_dict(), atol=3e-2, rtol=3e-2, msg=lambda m: f"{precision}: {m}")
    with torch.no_grad():
        root_dtype = module.model(x).dtype  # what training_step computes its loss from (no autocast under the policy)
    return {"loss": float(t.callback_metrics["train_loss"]), "ref_loss": loss.item(), "root_dtype": str(root_dtype)}


def case_cpu_offload() -> dict[str, Any]:
    """``cpu_offload=True`` reaches ``configure_model``'s ``fsdp_kwargs``; fit matches the reference; after set-up
    (``model_to_device`` included) and a further ``model_to_device``, the shards are still offloaded to the CPU."""
    t = trainer(2, 1, 2, max_steps=4, cpu_offload=True)
    module = lightning().LlamaModule()
    t.fit(module, loader(per_rank(2)))
    assert_weights(module, reference_run(4)[0], "fit 2x1 with cpu_offload")
    t.strategy.model_to_device()
    block = module.model.layers[0]
    # No public API says whether FSDP2 offloads a unit; the test reads its parameter group.
    offloaded = block._get_fsdp_state()._fsdp_param_group.fsdp_params[0].offload_to_cpu
    return {"offloaded": bool(offloaded), "devices": sorted({str(p.device) for p in module.parameters()})}


def case_save_checkpoint_into_existing_folders(root: Path) -> dict[str, Any]:
    """``trainer.save_checkpoint`` into folders made beforehand, over previous checkpoints and among the user's files."""
    trainers, modules = {}, {}
    for fmt in ("dist", "full"):
        trainers[fmt] = trainer(2, 1, 2, max_steps=1, save_distributed_checkpoint=fmt == "dist")
        modules[fmt] = lightning().LlamaModule()
        trainers[fmt].fit(modules[fmt], loader(per_rank(2)))
    rank = trainers["dist"].global_rank
    out: dict[str, Any] = {}
    for fmt, t in trainers.items():
        for before in ("empty", "meta-only", "previous-dist", "previous-full"):
            path = root / f"{fmt}-over-{before}.ckpt"
            if before.startswith("previous"):
                trainers[before.removeprefix("previous-")].save_checkpoint(path)
            elif rank == 0:
                path.mkdir(parents=True)
                if before == "meta-only":  # what a Lightning save that stopped early leaves
                    torch.save({"global_step": -1}, path / "meta.pt")
            t.strategy.barrier()
            t.save_checkpoint(path)
            t.strategy.barrier()
            saved = torch.load(path / "meta.pt" if fmt == "dist" else path, weights_only=False)
            out[f"{fmt}-over-{before}"] = (path.is_dir() == (fmt == "dist"), saved["global_step"])
        foreign = root / f"{fmt}-foreign"
        if rank == 0:
            foreign.mkdir(parents=True)
            (foreign / "notes.txt").write_text("keep me")
        t.strategy.barrier()
        if fmt == "full":  # a file cannot sit where the folder is
            with pytest.raises(
                IsADirectoryError, match=r"exists and is a directory that is not a checkpoint \(it holds 'notes.txt'"
            ):
                t.save_checkpoint(foreign)
        else:  # written among the user's files, which stay, as with Lightning's strategy
            t.save_checkpoint(foreign)
            t.strategy.barrier()
        out[f"{fmt}-foreign"] = sorted(p.name for p in foreign.iterdir()), (foreign / "notes.txt").read_text()
    for t in trainers.values():
        t.strategy.teardown()  # waits for the deletion of the checkpoints replaced (rank 0)
    trainers["dist"].strategy.barrier()
    out["leftovers"] = sorted(p.name for p in root.glob(".*"))
    return out


def grid_two(namespace: str, root: Path) -> dict[str, Any]:
    use_namespace(namespace)
    out: dict[str, Any] = {"errors": case_setup_errors()}
    out["existing_folders"] = case_save_checkpoint_into_existing_folders(root)
    for precision in _DTYPES:
        out[f"precision_{precision}"] = case_precision(precision)
    out["cpu_offload"] = case_cpu_offload()
    for dp, tp in ((2, 1), (1, 2)):
        out[f"fit_{dp}x{tp}"] = case_fit_validate_test_predict(dp, tp, 2)
        for mode in ("sharded", "unsharded"):
            out[f"accumulate_{mode}_{dp}x{tp}"] = case_accumulation_skips_reduction(dp, tp, 2, mode)
        for parallelize_fn in (True, False):
            out[f"rerun_{dp}x{tp}_{parallelize_fn}"] = case_rerun_fit_validate_test_predict_fit(
                dp, tp, 2, parallelize_fn
            )
    return out


def grid_four(root: Path, namespace: str) -> dict[str, Any]:
    use_namespace(namespace)
    out: dict[str, Any] = {"fit_2x2": case_fit_validate_test_predict(2, 2, 4, nodes=2)}
    for distributed in (True, False):
        out[f"ckpt_{distributed}"] = case_checkpoints_and_resume(root, distributed)
        out[f"lightning_{distributed}"] = case_lightning_checkpoints_load_into_ours(root, distributed)
    out["single_device"] = case_single_device_interchange(root)
    return out


# ---------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------
def _single_device_trainer(**kwargs: Any) -> Any:
    return quiet_trainer(
        accelerator="cpu",
        devices=1,
        **kwargs,
    )


@pytest.fixture(scope="module", params=TRAINER_NAMESPACES)
def namespace(request: pytest.FixtureRequest) -> Any:
    use_namespace(request.param)  # for the single-device runs in this process
    yield request.param
    use_namespace(TRAINER_NAMESPACES[0])


@pytest.fixture(scope="module")
def two(namespace: str, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(grid_two, 2, namespace, tmp_path_factory.mktemp("trainer-two"))


#: The one namespace of the 4-process grid. Both namespaces run the 2-process grid (every stage, precision, offload
#: and save); modelpar resolves the namespace in one place, and what the 4-process grid adds (ModelCheckpoint,
#: resuming on another layout, Lightning's checkpoints, single-device interchange) reads files, not classes. Run
#: in both namespaces, the file took 45 s of CPU more on 2 cores (168 against 123 s alone, 2026-11-27).
FOUR_NAMESPACE = "lightning.pytorch"


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("trainer")
    with namespace_of(FOUR_NAMESPACE):
        checkpoint = lightning().ModelCheckpoint(dirpath=root / "single-device")
        single = _single_device_trainer(max_epochs=1, callbacks=[checkpoint])
        single.fit(lightning().LlamaModule(), loader(GLOBAL_BATCH))
    return root, run_distributed(grid_four, 4, root, FOUR_NAMESPACE, nodes=2)


@pytest.mark.parametrize("layout", ["2x1", "1x2"])
def test_fit_validate_test_predict_match_the_reference(two, layout):
    dp, tp = (int(v) for v in layout.split("x"))
    assert all(r[f"fit_{layout}"]["mesh"] == (dp, tp) for r in two)
    # sync_dist with reduce_fx="sum" adds one value per data-parallel rank, not one per process
    assert all(r[f"fit_{layout}"]["dp_rank_sum"] == sum(range(1, dp + 1)) for r in two)


def test_save_checkpoint_goes_into_existing_folders_keeping_the_users_files_or_refuses_them_for_a_file(two):
    for result in (r["existing_folders"] for r in two):
        for fmt in ("dist", "full"):
            for before in ("empty", "meta-only", "previous-dist", "previous-full"):
                assert result[f"{fmt}-over-{before}"] == (True, 1), (fmt, before)
        assert result["full-foreign"] == (["notes.txt"], "keep me")
        assert result["dist-foreign"] == (
            [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "notes.txt"],
            "keep me",
        )
        assert result["leftovers"] == []


@pytest.mark.parametrize("layout", ["2x1", "1x2"])
def test_accumulation_reduces_as_the_mode_says_and_matches_reference(two, layout):
    for r in two:
        # "unsharded": micro-batches alternate: not reduced (no sharded .grad yet), then reduced (sharded .grad)
        assert r[f"accumulate_unsharded_{layout}"] == [True, False, True, False]
        # "sharded" (default): every micro-batch reduce-scatters into the sharded .grad
        assert r[f"accumulate_sharded_{layout}"] == [False, False, False, False]


def test_fit_on_2x2_matches_reference_with_auto_sizes_on_two_nodes(four):
    _, results = four
    assert all(r["fit_2x2"]["mesh"] == (2, 2) and r["fit_2x2"]["dp_rank_sum"] == 3 for r in results)


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "full"])
def test_model_checkpoint_saves_resave_and_resume_on_another_layout(four, distributed):
    root, results = four
    files = results[0][f"ckpt_{distributed}"]["files"]
    assert {"epoch=0-step=1.ckpt", "epoch=2-step=3.ckpt", "last.ckpt", "best", "weights"} <= set(files)
    assert len(results[0][f"ckpt_{distributed}"]["best"]) == 1  # the previous best was removed
    kind = Path.is_dir if distributed else Path.is_file
    assert kind(root / f"trainer-{'dist' if distributed else 'full'}" / "last.ckpt")


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "full"])
def test_checkpoints_from_lightnings_model_parallel_strategy_resume_here(four, distributed):
    assert all(r[f"lightning_{distributed}"] for r in four[1])


def test_single_device_checkpoints_resume_here_and_ours_resume_on_a_single_device(four):
    root, results = four
    assert all(r["single_device"] for r in results)
    with namespace_of(FOUR_NAMESPACE):
        module = lightning().LlamaModule()
        t = _single_device_trainer(max_epochs=3)
        t.fit(module, loader(GLOBAL_BATCH), ckpt_path=root / "from-modelpar-full" / "epoch=1-step=2.ckpt")
    torch.testing.assert_close(module.model.state_dict(), reference_run(3)[0].state_dict(), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("parallelize_fn", [True, False], ids=["parallelize_fn", "configure_model"])
@pytest.mark.parametrize("layout", ["2x1", "1x2"])
def test_one_trainer_reruns_fit_validate_test_predict_fit_on_one_module_like_the_reference(two, layout, parallelize_fn):
    for r in two:
        # weights after each run match the reference inside the case; here: one mesh, a fresh optimizer
        assert r[f"rerun_{layout}_{parallelize_fn}"] == {
            "mesh_reused": True,
            "optimizer_recreated": True,
            "global_step": 4,
        }


def test_a_module_nothing_parallelizes_is_sharded_by_the_strategy_and_a_replaced_module_is_refused(two):
    without_warning = [{k: v for k, v in r["errors"].items() if k != "neither_warning"} for r in two]
    assert without_warning[0] == without_warning[1]
    assert two[0]["errors"]["neither"] == "sharded: True"
    assert [r["errors"]["neither_warning"] for r in two] == ["True", "False"]  # warned on rank 0 only


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-true"])
def test_precision_flags_train_like_the_reference_in_the_same_precision(two, precision):
    result = two[0][f"precision_{precision}"]
    assert abs(result["loss"] - result["ref_loss"]) < 3e-2, result
    # "bf16-mixed" runs FSDP2's bf16 policy without autocast, yet the root's logits are fp32 (as autocast's loss is)
    want = {"bf16-mixed": "torch.float32", "bf16-true": "torch.bfloat16", "16-true": "torch.float16"}[precision]
    assert all(r[f"precision_{precision}"]["root_dtype"] == want for r in two)


def test_cpu_offload_trains_like_the_reference_and_model_to_device_leaves_the_shards_on_the_cpu(two):
    assert all(r["cpu_offload"] == {"offloaded": True, "devices": ["cpu"]} for r in two)
