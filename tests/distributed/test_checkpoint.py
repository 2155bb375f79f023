"""Checkpoints on real process groups: resharding across layouts, both formats, in-place restore, filters.

The truth is a single-process model trained two AdamW steps. It is saved without any process group
("1p"); every layout loads it and re-saves, and every load anywhere must reproduce the truth exactly
(model weights and Adam moments, gathered). Three spawns make the whole matrix:
2 processes (2x1, 1x2) -> 4 processes as two nodes (2x2, 4x1, 1x4) -> 2 processes again (4-process files).
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from harness import run_distributed
from modelpar.checkpoint import load_state, save_state
from parity import adamw, global_batches, lm_loss, make_fabric, reference_model

LR = 1e-2


def trained_reference() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = reference_model()
    opt = adamw(model.parameters(), lr=LR)
    for x, y in global_batches(2):
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def gathered(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    model = getattr(model, "module", model)
    opts = StateDictOptions(full_state_dict=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, opt, options=opts)


def assert_same_as_truth(model: nn.Module, opt: torch.optim.Optimizer, where: str) -> None:
    want_model, want_opt = gathered(*trained_reference())
    got_model, got_opt = gathered(model, opt)
    torch.testing.assert_close(got_model, want_model, atol=0, rtol=0, msg=lambda m: f"{where} model: {m}")
    torch.testing.assert_close(got_opt["state"], want_opt["state"], atol=0, rtol=0, msg=lambda m: f"{where}: {m}")


def fresh(fabric: Any) -> tuple[Any, Any]:
    """A sharded model from another seed with an optimizer whose state exists (so loading must overwrite)."""
    model = fabric.setup_module(reference_model(seed=7))
    opt = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
    x, y = global_batches(1, seed=99)[0]
    fabric.backward(lm_loss(model(x), y))
    opt.step()
    opt.zero_grad()
    return model, opt


LAYOUTS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4)]}


def _load_all_then_save(root: Path, world: int, sources: list[str], save: bool) -> list[str]:
    nodes = 2 if world == 4 else 1
    loaded = []
    for dp, tp in LAYOUTS[world]:
        for src in sources:
            fabric = make_fabric(dp, tp, world_size=world, num_nodes=nodes)
            model, opt = fresh(fabric)
            state = {"model": model, "optimizer": opt, "step": 0}
            fabric.load(root / src, state)
            assert state["step"] == 2
            assert_same_as_truth(model, opt, f"{src} -> {dp}x{tp}")
            loaded.append(f"{src}->{dp}x{tp}")
        if save:
            fabric.save(root / f"{dp}x{tp}", {"model": model, "optimizer": opt, "step": 2})
    return loaded


def grid_first_two(root: Path) -> dict[str, Any]:
    return {"loaded": _load_all_then_save(root, 2, ["1p"], save=True), "lightning": case_lightning_interchange(root)}


def case_lightning_interchange(root: Path) -> list[str]:
    """Checkpoints move both ways between Lightning's strategy and ours, in both formats."""
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import ModelParallelStrategy as LightningStrategy

    from harness import PG_TIMEOUT
    from modelpar.plans import parallelize_llama

    done = []
    for distributed in (True, False):
        tag = "dist" if distributed else "full"
        lightning = Fabric(
            accelerator="cpu",
            devices=2,
            strategy=LightningStrategy(
                parallelize_llama, 1, 2, save_distributed_checkpoint=distributed, timeout=PG_TIMEOUT
            ),
        )
        lightning.launch()
        ours = make_fabric(2, 1, world_size=2, save_distributed_checkpoint=distributed)
        # Lightning writes, we read
        l_model, l_opt = fresh(lightning)
        lightning.load(root / "1x2", {"model": l_model, "optimizer": l_opt})  # ours -> Lightning
        assert_same_as_truth(l_model, l_opt, f"modelpar 1x2 -> Lightning ({tag})")
        lightning.save(root / f"from-lightning-{tag}", {"model": l_model, "optimizer": l_opt, "step": 2})
        o_model, o_opt = fresh(ours)
        state = {"model": o_model, "optimizer": o_opt, "step": 0}
        ours.load(root / f"from-lightning-{tag}", state)
        assert state["step"] == 2
        assert_same_as_truth(o_model, o_opt, f"Lightning ({tag}) -> modelpar")
        # we write, Lightning reads
        ours.save(root / f"from-modelpar-{tag}", {"model": o_model, "optimizer": o_opt, "step": 2})
        l_model2, l_opt2 = fresh(lightning)
        lightning.load(root / f"from-modelpar-{tag}", {"model": l_model2, "optimizer": l_opt2, "step": 0})
        assert_same_as_truth(l_model2, l_opt2, f"modelpar ({tag}) -> Lightning")
        done.append(tag)
    return done


def grid_four(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"loaded": _load_all_then_save(root, 4, ["1p", "2x1", "1x2"], save=True)}
    out["cross"] = _load_all_then_save(root, 4, ["2x2", "4x1", "1x4"], save=False)
    out.update(case_full_format(root), **case_stateful_filter_and_errors(root))
    out.update(case_async_snapshots(root), **case_several_models_and_bad_files(root))
    return out


def grid_second_two(root: Path) -> list[str]:
    return _load_all_then_save(root, 2, ["2x2", "4x1", "1x4", "full.pt"], save=False)


def case_full_format(root: Path) -> dict[str, Any]:
    fabric = make_fabric(2, 2, world_size=4, num_nodes=2, save_distributed_checkpoint=False)
    model, opt = fresh(fabric)
    fabric.load(root / "2x2", {"model": model, "optimizer": opt})
    path = root / "full.pt"
    fabric.save(path, {"model": model, "optimizer": opt, "step": 2})
    assert path.is_file()
    model2, opt2 = fresh(fabric)
    fabric.load(path, {"model": model2, "optimizer": opt2})
    assert_same_as_truth(model2, opt2, "full.pt -> 2x2")
    # load_raw of a raw state-dict file into a sharded module
    raw = root / "raw.pt"
    if dist.get_rank() == 0:
        torch.save(trained_reference()[0].state_dict(), raw)
    dist.barrier()
    model3, _ = fresh(fabric)
    fabric.load_raw(raw, model3)
    full_opts = StateDictOptions(full_state_dict=True)
    got = get_model_state_dict(model3.module, options=full_opts)
    torch.testing.assert_close(got, trained_reference()[0].state_dict(), atol=0, rtol=0)
    # replacing the file by a folder and back, at the same path
    fabric.strategy._core.save_distributed_checkpoint = True
    fabric.save(root / "swap", {"model": model})
    fabric.strategy._core.save_distributed_checkpoint = False
    fabric.save(root / "swap", {"model": model})
    swapped_to_file = (root / "swap").is_file()
    fabric.strategy._core.save_distributed_checkpoint = True
    fabric.save(root / "swap", {"model": model})
    return {"swap": [swapped_to_file, (root / "swap" / ".metadata").is_file()]}


class Tag:
    """A custom, non-stateful object: pickled as is, so loading it needs `weights_only=False`."""

    def __init__(self, name: str) -> None:
        self.name = name


class Counter:
    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.count = sd["count"]


def case_stateful_filter_and_errors(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for distributed in (True, False):
        tag = "dist" if distributed else "full"
        fabric = make_fabric(2, 2, world_size=4, num_nodes=2, save_distributed_checkpoint=distributed)
        model, opt = fresh(fabric)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        sched.step()
        sched.step()
        counter = Counter()
        counter.count = 5
        path = root / f"stateful-{tag}"
        fabric.save(path, {"model": model, "optimizer": opt, "sched": sched, "counter": counter, "extra": 1})
        # in-place restore of stateful objects; unrequested entries returned
        model2, opt2 = fresh(fabric)
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
        counter2 = Counter()
        state = {"model": model2, "optimizer": opt2, "sched": sched2, "counter": counter2}
        remainder = fabric.load(path, state)
        assert state["sched"] is sched2 and sched2.last_epoch == 2 and state["counter"] is counter2
        assert counter2.count == 5 and remainder == {"extra": 1}, remainder
        # optimizer-only state: its model is known to the strategy
        opt_only = {"optimizer": opt2}
        fabric.load(path, opt_only)
        # filtered save: only norms; loads back with strict=False, refuses with strict=True
        filtered = root / f"filtered-{tag}"
        fabric.save(filtered, {"model": model}, filter={"model": lambda k, v: "norm" in k})
        model3, _ = fresh(fabric)
        before = {k: v.full_tensor().clone() for k, v in model3.state_dict().items()}
        with pytest.raises(KeyError, match=r"(tok_embeddings|missing)"):
            fabric.load(filtered, {"model": model3})
        fabric.load(filtered, {"model": model3}, strict=False)
        src = {k: v.full_tensor() for k, v in model.state_dict().items()}
        for k, v in model3.state_dict().items():
            torch.testing.assert_close(v.full_tensor(), src[k] if "norm" in k else before[k], atol=0, rtol=0)
        out[f"filtered_{tag}"] = True
    # errors, on every rank
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at '.*nowhere'") as e1:
        fabric.load(root / "nowhere", {"model": model})
    (root / "empty-dir").mkdir(exist_ok=True)
    dist.barrier()
    with pytest.raises(ValueError, match=r"does not point to a valid checkpoint: it has no '\.metadata' file") as e2:
        fabric.load(root / "empty-dir", {"model": model})
    out["errors"] = [str(e1.value), str(e2.value)]
    return out


def _weights(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in gathered(model, torch.optim.SGD(model.parameters(), lr=0.1))[0].items()}


def case_async_snapshots(root: Path) -> dict[str, Any]:
    """An async save returns at once; changes made right after it do not leak into the checkpoint."""
    out = {}
    for distributed in (True, False):
        tag = "dist" if distributed else "full"
        fabric = make_fabric(2, 2, world_size=4, num_nodes=2, save_distributed_checkpoint=distributed, async_save=True)
        model, opt = fresh(fabric)
        at_save = _weights(model)
        meta = {"seen": [1]}
        fabric.save(root / f"async-{tag}", {"model": model, "optimizer": opt, "meta": meta})
        with torch.no_grad():  # training goes on while the checkpoint is written
            for p in model.parameters():
                p.add_(1.0)
        meta["seen"].append(2)
        fabric.save(root / f"async-{tag}", {"model": model, "optimizer": opt, "meta": meta})  # waits, then saves
        after_second = _weights(model)
        model2, opt2 = fresh(fabric)
        state = {"model": model2, "optimizer": opt2, "meta": None}
        fabric.load(root / f"async-{tag}", state)  # waits for the background write
        torch.testing.assert_close(_weights(model2), after_second, atol=0, rtol=0)
        assert state["meta"] == {"seen": [1, 2]}
        assert any(not torch.equal(after_second[k], at_save[k]) for k in at_save)
        # the snapshot taken by the first save is what a save-then-mutate sequence writes
        fabric.save(root / f"async-snap-{tag}", {"model": model})
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0)
        fabric.strategy.teardown()  # waits for the background write
        model3, _ = fresh(fabric)
        fabric.load(root / f"async-snap-{tag}", {"model": model3})
        torch.testing.assert_close(_weights(model3), after_second, atol=0, rtol=0)
        out[f"async_{tag}"] = True
    return out


def case_several_models_and_bad_files(root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for distributed in (True, False):
        tag = "dist" if distributed else "full"
        fabric = make_fabric(2, 2, world_size=4, num_nodes=2, save_distributed_checkpoint=distributed)
        gen, gen_opt = fresh(fabric)
        disc = fabric.setup_module(reference_model(seed=3))
        disc_opt = fabric.setup_optimizers(adamw(disc.parameters(), lr=LR))
        fabric.save(root / f"two-{tag}", {"gen": gen, "gen_opt": gen_opt, "disc": disc, "disc_opt": disc_opt})
        gen2, gen_opt2 = fresh(fabric)
        disc2, disc_opt2 = fresh(fabric)
        fabric.load(root / f"two-{tag}", {"gen": gen2, "gen_opt": gen_opt2, "disc": disc2, "disc_opt": disc_opt2})
        torch.testing.assert_close(_weights(gen2), _weights(gen), atol=0, rtol=0)
        torch.testing.assert_close(_weights(disc2), _weights(disc), atol=0, rtol=0)
        # load_raw: the model's key is found in a folder; a raw file is a plain state dict
        if distributed:
            with pytest.raises(ValueError, match=r"Cannot tell which model .* under \['disc', 'gen'\]"):
                fabric.load_raw(root / f"two-{tag}", gen2)
            fabric.save(root / "one-model", {"model": disc})
            fabric.load_raw(root / "one-model", gen2)
            torch.testing.assert_close(_weights(gen2), _weights(disc), atol=0, rtol=0)
        # a model of another shape: named key and both shapes, on every rank
        from modelpar.models import Llama, LlamaConfig

        other = fabric.setup_module(
            Llama(LlamaConfig(vocab_size=128, dim=32, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=64))
        )
        with pytest.raises(
            ValueError,
            match=r"Shape mismatch for 'tok_embeddings.weight' .* checkpoint has \(64, 32\), the model expects \(128, 32\)",
        ) as e:
            fabric.load(root / f"two-{tag}", {"gen": other}, strict=False)
        out[f"shape_{tag}"] = str(e.value)
    # custom objects in metadata need weights_only=False
    fabric.save(root / "custom-meta", {"model": gen, "obj": Tag("v1")})
    with pytest.raises(ValueError, match=r"holds `test_checkpoint.Tag`, which loading with `weights_only=True`"):
        fabric.load(root / "custom-meta", {"model": gen, "obj": None})
    state = {"model": gen, "obj": None}
    fabric.load(root / "custom-meta", state, weights_only=False)
    assert isinstance(state["obj"], Tag) and state["obj"].name == "v1"
    # a truncated file and a folder whose save never finished
    if dist.get_rank() == 0:
        data = (root / "full.pt").read_bytes()
        (root / "truncated.pt").write_bytes(data[: len(data) // 2])
        (root / "unfinished").mkdir(exist_ok=True)
        for shard in (root / "2x2").glob("*.distcp"):
            (root / "unfinished" / shard.name).write_bytes(shard.read_bytes())
    dist.barrier()
    with pytest.raises(ValueError, match=r"truncated\.pt' cannot be read: it is truncated, corrupt"):
        fabric.load(root / "truncated.pt", {"model": gen})
    with pytest.raises(ValueError, match=r"unfinished' is incomplete: it has shard files but no '\.metadata'"):
        fabric.load(root / "unfinished", {"model": gen})
    # one damaged shard file, read by some ranks only: every rank raises, naming a rank that failed
    if dist.get_rank() == 0:
        shutil.copytree(root / "2x2", root / "bad-shard", dirs_exist_ok=True)
        (root / "bad-shard" / "__1_0.distcp").write_bytes(b"")
    dist.barrier()
    with pytest.raises(ValueError, match=r"bad-shard' failed on rank \d.*: it is truncated or corrupt"):
        fabric.load(root / "bad-shard", {"model": gen})
    out["bad_files"] = True
    return out


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt")
    model, opt = trained_reference()
    save_state(root / "1p", {"model": model, "optimizer": opt, "step": 2}, full=False)  # no process group
    return {
        "root": root,
        "first": run_distributed(grid_first_two, 2, root),
        "four": run_distributed(grid_four, 4, root, nodes=2),
        "second": run_distributed(grid_second_two, 2, root),
    }


def test_distributed_checkpoints_reshard_between_all_layouts(matrix):
    sources = {"1p", "2x1", "1x2", "2x2", "4x1", "1x4"}
    pairs = set(matrix["first"][0]["loaded"]) | set(matrix["four"][0]["loaded"]) | set(matrix["four"][0]["cross"])
    pairs |= set(matrix["second"][0])
    assert {p.split("->")[0] for p in pairs} >= sources
    assert {p.split("->")[1] for p in pairs} == {"2x1", "1x2", "2x2", "4x1", "1x4"}
    assert len(pairs) == 2 * 1 + 3 * 3 + 3 * 3 + 2 * 4


def test_every_layout_checkpoint_loads_into_a_plain_single_process_module(matrix):
    for src in ("2x1", "1x2", "2x2", "4x1", "1x4"):
        model = reference_model(seed=7)
        opt = adamw(model.parameters(), lr=LR)
        state = {"model": model, "optimizer": opt, "step": 0}
        load_state(matrix["root"] / src, state)
        assert state["step"] == 2
        assert_same_as_truth(model, opt, f"{src} -> 1 process")


def test_full_checkpoint_file_loads_into_a_plain_module_with_optimizer_keyed_by_name(matrix):
    raw = torch.load(matrix["root"] / "full.pt", weights_only=True)
    assert set(raw) == {"model", "optimizer", "step"} and raw["step"] == 2
    assert "layers.0.attention.wq.weight" in raw["optimizer"]["state"]
    model = copy.deepcopy(reference_model(seed=7))
    model.load_state_dict(raw["model"])
    torch.testing.assert_close(model.state_dict(), trained_reference()[0].state_dict(), atol=0, rtol=0)


def test_a_file_and_a_folder_replace_each_other_at_the_same_path(matrix):
    assert matrix["four"][0]["swap"] == [True, True]


def test_stateful_objects_restore_in_place_and_filtered_saves_load_with_strict_false(matrix):
    assert all(r["filtered_dist"] and r["filtered_full"] for r in matrix["four"])


def test_bad_paths_raise_the_same_clear_error_on_every_rank(matrix):
    errors = [r["errors"] for r in matrix["four"]]
    assert all(e == errors[0] for e in errors)


def test_async_saves_write_the_state_at_save_time_and_are_awaited(matrix):
    assert all(r["async_dist"] and r["async_full"] for r in matrix["four"])


def test_several_models_with_their_optimizers_in_one_checkpoint_and_clear_errors_for_bad_files(matrix):
    four = matrix["four"]
    assert all(r["bad_files"] for r in four)
    assert len({r["shape_dist"] for r in four}) == 1 and len({r["shape_full"] for r in four}) == 1


def test_a_2x2_checkpoint_converts_to_one_file_and_back_offline(matrix, tmp_path):
    from modelpar.checkpoint import convert_to_distributed, convert_to_file, describe_checkpoint

    assert len(list((matrix["root"] / "2x2").glob("*.distcp"))) == 4  # one shard file per rank
    convert_to_file(matrix["root"] / "2x2", tmp_path / "one.pt", progress=False)
    convert_to_distributed(tmp_path / "one.pt", tmp_path / "again", progress=False)
    for src in (tmp_path / "one.pt", tmp_path / "again"):
        model = reference_model(seed=7)
        opt = adamw(model.parameters(), lr=LR)
        state = {"model": model, "optimizer": opt, "step": 0}
        load_state(src, state)
        assert state["step"] == 2
        assert_same_as_truth(model, opt, f"2x2 -> {src.name}")
    text = describe_checkpoint(matrix["root"] / "2x2")
    assert "distributed" in text and "model.tok_embeddings.weight" in text


def test_checkpoints_move_both_ways_between_lightning_and_modelpar_in_both_formats(matrix):
    assert all(r["lightning"] == ["dist", "full"] for r in matrix["first"])
