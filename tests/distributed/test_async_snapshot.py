"""An asynchronous save writes a snapshot: training that goes on after ``save`` returns never reaches the file.

The disk is slow on purpose. In the worker processes every write issued from a background thread (the
single file's ``torch.save``, DCP's shard writer) is held back until the training loop has taken three more
AdamW steps and changed the metadata dict it passed to ``save``. The checkpoint must still hold, bit for bit,
the state at the moment ``save`` returned: the weights, the Adam moments and ``step``, the param groups and
the metadata. One spawn of 2 gloo processes runs both formats on a 2x1 and a 1x2 mesh.

The same spawn checks what a save costs and where it may go: an asynchronous save stages each byte once
(the full format writes rank 0's gathered state as it is), each rank ``fsync``s the shards it wrote and rank 0
only the metadata and the folders, before the commit's rename; and saves go into a folder created beforehand
(empty, or holding only ``meta.pt``), over a previous checkpoint of either format, but never over a folder of
other files.
"""

from __future__ import annotations

import copy
import gc
import os
import re
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from harness import run_distributed
from modelpar.checkpoint import Checkpointer
from parity import adamw, global_batches, lm_loss, local_slice, make_fabric, reference_model

LR = 1e-2
CASES = [(2, 1, True), (2, 1, False), (1, 2, True), (1, 2, False)]  # (dp, tp, distributed)
#: What the steps and edits after ``save`` change (so a leak of any of them would be seen).
CHANGED_AFTER_SAVE = (
    *("/model/", "/exp_avg", "/exp_avg_sq", "/step"),
    *("/meta: keys", "/meta/epoch", "/meta/losses", "/meta/ema", "/meta/sched/lr"),
)


class SlowDisk:
    """Holds back every write from a background thread until :meth:`release`; the main thread writes at once."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self.background_writes = 0
        self._save = torch.save
        self._write_data = FileSystemWriter.write_data

    def __enter__(self) -> SlowDisk:
        disk = self

        def save(*args: Any, **kwargs: Any) -> Any:
            disk._wait()
            return disk._save(*args, **kwargs)

        def write_data(writer: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
            disk._wait()
            return disk._write_data(writer, *args, **kwargs)

        torch.save = save
        FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        torch.save = self._save
        FileSystemWriter.write_data = self._write_data  # type: ignore[method-assign]
        self._open.set()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def _wait(self) -> None:
        if threading.current_thread() is threading.main_thread():
            return
        self.background_writes += 1
        if not self._open.wait(timeout=60):
            raise TimeoutError("the slow disk was never released")


def train(fabric: Any, model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    for x, y in global_batches(steps, seed=seed):
        fabric.backward(lm_loss(model(local_slice(fabric, x)), local_slice(fabric, y)))
        opt.step()
        opt.zero_grad()


def frozen(model: nn.Module, opt: torch.optim.Optimizer, meta: Any) -> dict[str, Any]:
    """Everything a checkpoint should hold, gathered to full tensors and copied (``step`` is live otherwise)."""
    model = getattr(model, "module", model)
    options = StateDictOptions(full_state_dict=True)
    state = {"model": get_model_state_dict(model, options=options), "meta": meta}
    state["optimizer"] = get_optimizer_state_dict(model, opt, options=options)
    return copy.deepcopy(state)


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where ``got`` and ``want`` differ: tensors by dtype, shape and every value; the rest by ``==``."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return [f"{where}: {got!r} != {want!r}"]
        return [] if torch.equal(got, want) else [f"{where}: {got.flatten()[:3]} != {want.flatten()[:3]} ..."]
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{where}: {got!r} != {want!r}"]
        keys = [] if set(got) == set(want) else [f"{where}: keys {sorted(map(str, got))} != {sorted(map(str, want))}"]
        return keys + [d for k in want if k in got for d in differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return [f"{where}: {got!r} != {want!r}"]
        return [d for i, (g, w) in enumerate(zip(got, want, strict=True)) for d in differences(g, w, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


def case_snapshot(root: Path, disk: SlowDisk, dp: int, tp: int, distributed: bool) -> dict[str, Any]:
    tag = f"{dp}x{tp}-{'dist' if distributed else 'full'}"
    fabric = make_fabric(dp, tp, world_size=2, save_distributed_checkpoint=distributed, async_save=True)
    model = fabric.setup_module(reference_model())
    opt = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
    train(fabric, model, opt, steps=2, seed=1)
    meta = {"epoch": 3, "losses": [0.5, 0.25], "ema": torch.tensor([1.0, 2.0]), "sched": {"lr": LR}}

    disk.hold()
    writes_before = disk.background_writes
    fabric.save(root / tag, {"model": model, "optimizer": opt, "meta": meta})
    at_save = frozen(model, opt, meta)
    # Training goes on while the disk is still busy with the checkpoint.
    train(fabric, model, opt, steps=3, seed=2)
    meta["epoch"] = 4
    meta["losses"].append(0.125)
    meta["ema"].mul_(10)
    meta["sched"]["lr"] = 0.0
    meta["new"] = True
    changed = differences(frozen(model, opt, meta), at_save)
    disk.release()

    loaded = fabric.setup_module(reference_model(seed=7))
    loaded_opt = fabric.setup_optimizers(adamw(loaded.parameters(), lr=LR))
    train(fabric, loaded, loaded_opt, steps=1, seed=3)  # optimizer state exists, so loading must overwrite it
    state = {"model": loaded, "optimizer": loaded_opt, "meta": None}
    fabric.load(root / tag, state)  # waits for the background write
    return {
        "tag": tag,
        "wrong": differences(frozen(loaded, loaded_opt, state["meta"]), at_save),
        "changed": changed,
        "background_writes": disk.background_writes - writes_before,
    }


def nbytes(state: Any) -> int:
    """Bytes of the tensors in a nested state (a DTensor's shard on this rank)."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return local.numel() * local.element_size()
    if isinstance(state, dict):
        return sum(nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(nbytes(v) for v in state)
    return 0


def case_staged_once(root: Path) -> dict[str, Any]:
    """What an async save copies, against the state's size: full format (rank 0), distributed (every rank)."""
    out = {}
    for distributed in (False, True):
        fabric = make_fabric(2, 1, world_size=2, save_distributed_checkpoint=distributed, async_save=True)
        model = fabric.setup_module(reference_model())
        opt = fabric.setup_optimizers(adamw(model.parameters(), lr=LR))
        train(fabric, model, opt, steps=1, seed=1)
        options = StateDictOptions(full_state_dict=not distributed)
        state = {"model": get_model_state_dict(model.module, options=options)}
        state["optimizer"] = get_optimizer_state_dict(model.module, opt, options=options)
        fabric.save(root / f"staged-{distributed}", {"model": model, "optimizer": opt})
        checkpointer = fabric.strategy._core.checkpointer
        out["distributed" if distributed else "full"] = (checkpointer.staged_bytes, nbytes(state))
        fabric.strategy.teardown()
    return out


class FsyncLog:
    """Every ``fsync`` in this process (by the path of its descriptor) and every rename, with system-wide times."""

    def __init__(self) -> None:
        self.events: list[tuple[float, str, str]] = []
        self._fsync, self._replace = os.fsync, os.replace

    def __enter__(self) -> FsyncLog:
        log = self

        def fsync(fd: Any) -> None:
            log._fsync(fd)
            number = fd if isinstance(fd, int) else fd.fileno()
            log.events.append((time.monotonic(), "fsync", os.readlink(f"/proc/self/fd/{number}")))

        def replace(src: Any, dst: Any, **kwargs: Any) -> None:
            log._replace(src, dst, **kwargs)
            log.events.append((time.monotonic(), "replace", f"{src} -> {dst}"))

        os.fsync, os.replace = fsync, replace  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: Any) -> None:
        os.fsync, os.replace = self._fsync, self._replace  # type: ignore[assignment]


def case_who_fsyncs_what(root: Path) -> dict[str, Any]:
    """Per save (sync and async, distributed format, over a previous one): what this rank fsyncs, and when."""
    out = {}
    for async_save in (False, True):
        fabric = make_fabric(2, 1, world_size=2, async_save=async_save)
        model = fabric.setup_module(reference_model())
        path = root / f"fsync-{async_save}" / "ckpt"
        fabric.save(path, {"model": model, "step": 1})
        fabric.strategy._core.checkpointer.wait()
        with FsyncLog() as log:
            fabric.save(path, {"model": model, "step": 2})
            fabric.strategy.teardown()  # waits for the background write and the deletion of the previous one
        prefix = str(path.parent / ".ckpt.partial-")
        synced = [re.sub(r"partial-\w+", "partial-*", p) for _, op, p in log.events if op == "fsync"]
        commit = [t for t, op, p in log.events if op == "replace" and p.startswith(prefix) and p.endswith("ckpt")]
        shard_times = [t for t, op, p in log.events if op == "fsync" and p.endswith(".distcp")]
        out[f"async={async_save}"] = {"synced": synced, "commit": commit, "shards_synced_at": shard_times}
        dist.barrier()  # rank 0's teardown has waited for its deletion
        assert not list(path.parent.glob(".ckpt.*")), "leftovers after the save and teardown"
    return out


def case_existing_folders(root: Path) -> dict[str, Any]:
    """Saves into folders created beforehand, over previous checkpoints, and into a folder of the user's files."""
    rank = dist.get_rank()
    fabrics = {
        fmt: make_fabric(2, 1, world_size=2, save_distributed_checkpoint=fmt == "dist") for fmt in ("dist", "full")
    }
    models = {fmt: f.setup_module(reference_model()) for fmt, f in fabrics.items()}
    out: dict[str, Any] = {}
    for fmt, fabric in fabrics.items():
        for before in ("empty", "meta-only", "previous-dist", "previous-full"):
            path = root / "existing" / f"{fmt}-over-{before}"
            if before.startswith("previous"):
                other = before.removeprefix("previous-")
                fabrics[other].save(path, {"model": models[other], "step": 0})
            elif rank == 0:
                path.mkdir(parents=True)
                if before == "meta-only":  # what a Lightning save that stopped early leaves
                    torch.save({"step": -1}, path / "meta.pt")
            dist.barrier()
            fabric.save(path, {"model": models[fmt], "step": 1})
            state = {"model": fabric.setup_module(reference_model(seed=7)), "step": 0}
            fabric.load(path, state)
            same = all(torch.equal(a, b) for a, b in zip(_full(state["model"]), _full(models[fmt]), strict=True))
            out[f"{fmt}-over-{before}"] = (path.is_dir() == (fmt == "dist"), state["step"], same)
        foreign = root / "existing" / f"{fmt}-foreign"
        if rank == 0:
            foreign.mkdir(parents=True)
            (foreign / "notes.txt").write_text("keep me")
        dist.barrier()
        if fmt == "full":  # a file cannot sit where the folder is
            with pytest.raises(IsADirectoryError) as raised:
                fabric.save(foreign, {"model": models[fmt], "step": 1})
            out[f"{fmt}-foreign"] = (str(raised.value), (foreign / "notes.txt").read_text())
            continue
        # the distributed format goes in among the user's files, as Lightning's strategy's does, twice (over itself)
        for step in (1, 2):
            fabric.save(foreign, {"model": models[fmt], "step": step})
        state = {"model": fabric.setup_module(reference_model(seed=7)), "step": 0}
        fabric.load(foreign, state)
        same = all(torch.equal(a, b) for a, b in zip(_full(state["model"]), _full(models[fmt]), strict=True))
        out[f"{fmt}-foreign"] = (state["step"], same, (foreign / "notes.txt").read_text(), _names(foreign))
    for fabric in fabrics.values():
        fabric.strategy.teardown()
    dist.barrier()  # rank 0's teardown has waited for its deletions
    out["leftovers"] = sorted(p.name for p in (root / "existing").glob(".*"))
    return out


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _full(model: nn.Module) -> list[torch.Tensor]:
    sd = get_model_state_dict(getattr(model, "module", model), options=StateDictOptions(full_state_dict=True))
    return list(sd.values())


def grid(root: Path) -> dict[str, Any]:
    with SlowDisk() as disk:
        snapshots = [case_snapshot(root, disk, dp, tp, distributed) for dp, tp, distributed in CASES]
    return {
        "snapshots": snapshots,
        "staged": case_staged_once(root),
        "fsync": case_who_fsyncs_what(root),
        "existing": case_existing_folders(root),
    }


@pytest.fixture(scope="module")
def spawn(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(grid, 2, tmp_path_factory.mktemp("async"))


def test_async_saves_write_the_state_at_save_time_while_the_training_goes_on(spawn):
    ranks = [r["snapshots"] for r in spawn]
    wrong = [f"rank {rank}, {r['tag']}: {d}" for rank, rs in enumerate(ranks) for r in rs for d in r["wrong"][:4]]
    assert not wrong, "the checkpoint is not the state at save time:\n" + "\n".join(wrong)
    for rank, results in enumerate(ranks):
        for r in results:
            # the steps after the save changed weights, moments, step and metadata: the test can see a leak
            changed = " ".join(r["changed"])
            for what in CHANGED_AFTER_SAVE:
                assert what in changed, f"{r['tag']}: {what} did not change after the save"
            # the writes went through the slow disk, from the background: DCP writes on every rank, a file on rank 0
            if r["tag"].endswith("dist") or rank == 0:
                assert r["background_writes"] > 0, f"rank {rank}, {r['tag']}: no background write"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # DCP without a process group
def test_async_staging_copies_are_reused_while_shapes_match_and_released_by_close(tmp_path):
    model = nn.Linear(4, 3)
    opt = adamw(model.parameters(), lr=LR)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    checkpointer = Checkpointer(async_save=True)
    checkpointer.save(tmp_path / "a", {"model": model, "optimizer": opt, "step": 1}, full=False)
    checkpointer.wait()
    stager = checkpointer._stager()  # the one the distributed format stages with
    first = stager.stage({"w": model.weight.detach()})["w"]
    again = stager.stage({"w": model.weight.detach() + 1})["w"]
    assert again.data_ptr() == first.data_ptr(), "a tensor of the same shape reuses its staging copy"
    assert torch.equal(again, model.weight + 1)
    bigger = stager.stage({"w": torch.zeros(5, 4)})["w"]
    assert bigger.data_ptr() != first.data_ptr() and bigger.shape == (5, 4)
    kept = weakref.ref(bigger)
    del first, again, bigger, stager
    gc.collect()
    assert kept() is not None, "the stager keeps its copies between saves"
    checkpointer.close()
    gc.collect()
    assert kept() is None, "close() releases the staging copies"
    # still usable after close(), e.g. by a second Trainer run with the same strategy
    checkpointer.save(tmp_path / "a", {"model": model, "optimizer": opt, "step": 2}, full=True)
    state = {"model": nn.Linear(4, 3), "step": 0}
    checkpointer.load(tmp_path / "a", state)
    assert state["step"] == 2 and torch.equal(state["model"].weight, model.weight)
    checkpointer.close()


def test_async_saves_stage_each_byte_once_and_the_full_format_does_not_restage_rank_0s_gathered_state(spawn):
    rank0, rank1 = (r["staged"] for r in spawn)
    staged, state = rank0["full"]
    # only what shares memory with the live optimizer is copied (its `step` counters): not the gathered state
    assert 0 < staged < 0.01 * state, (staged, state)
    assert rank1["full"][0] == 0  # rank 1 writes nothing in the full format
    for rank in (rank0, rank1):  # distributed: each shard copied once, from where it lives, into the stager
        staged, state = rank["distributed"]
        assert staged == state, (staged, state)


def test_each_rank_fsyncs_the_shards_it_wrote_and_rank_0_the_metadata_and_folders_before_the_rename(spawn, tmp_path):
    for case in ("async=False", "async=True"):
        rank0, rank1 = (r["fsync"][case] for r in spawn)
        names = [{Path(p).name if "partial-*" in p else p for p in r["synced"]} for r in (rank0, rank1)]
        for rank, synced in enumerate(names):
            shards = {n for n in synced if n.endswith(".distcp")}
            assert shards == {f"__{rank}_0.distcp"}, (case, rank, synced)
        assert {".metadata", "meta.pt", ".ckpt.partial-*"} <= names[0], (case, names[0])
        assert any(p.endswith("fsync-" + case.split("=")[1]) for p in names[0]), ("parent folder", names[0])
        assert names[1] == {"__1_0.distcp"}, (case, "rank 1 syncs only its own shard", names[1])
        assert len(rank0["commit"]) == 1 and rank1["commit"] == []
        # the durability order: every rank's shards are durable before rank 0 renames the checkpoint into place
        assert max(rank0["shards_synced_at"] + rank1["shards_synced_at"]) < rank0["commit"][0], case


def test_saves_go_into_existing_folders_keeping_the_users_files_or_refuse_them_for_a_full_file_on_every_rank(spawn):
    for result in (r["existing"] for r in spawn):
        for fmt in ("dist", "full"):
            for before in ("empty", "meta-only", "previous-dist", "previous-full"):
                assert result[f"{fmt}-over-{before}"] == (True, 1, True), (fmt, before)
        message, notes = result["full-foreign"]
        assert notes == "keep me"
        assert re.search(
            r"the path exists and is a directory that is not a checkpoint \(it holds 'notes.txt'", message
        ), message
        assert "Choose a path inside it, an empty folder, or a new path" in message
        files = [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", "notes.txt"]
        assert result["dist-foreign"] == (2, True, "keep me", files)
        assert result["leftovers"] == []
