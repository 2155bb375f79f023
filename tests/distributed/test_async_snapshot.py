"""An asynchronous save writes a snapshot: training that goes on after ``save`` returns never reaches the file.

The disk is slow on purpose. In the worker processes every write issued from a background thread (the
single file's ``torch.save``, DCP's shard writer) is held back until the training loop has taken three more
AdamW steps and changed the metadata dict it passed to ``save``. The checkpoint must still hold, bit for bit,
the state at the moment ``save`` returned: the weights, the Adam moments and ``step``, the param groups and
the metadata. One spawn of 2 gloo processes runs both formats on a 2x1 and a 1x2 mesh.
"""

from __future__ import annotations

import copy
import gc
import threading
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from harness import run_distributed
from modelpar.checkpoint import Checkpointer
from parity import global_batches, lm_loss, local_slice, make_fabric, reference_model

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
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
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
    loaded_opt = fabric.setup_optimizers(torch.optim.AdamW(loaded.parameters(), lr=LR))
    train(fabric, loaded, loaded_opt, steps=1, seed=3)  # optimizer state exists, so loading must overwrite it
    state = {"model": loaded, "optimizer": loaded_opt, "meta": None}
    fabric.load(root / tag, state)  # waits for the background write
    return {
        "tag": tag,
        "wrong": differences(frozen(loaded, loaded_opt, state["meta"]), at_save),
        "changed": changed,
        "background_writes": disk.background_writes - writes_before,
    }


def grid(root: Path) -> list[dict[str, Any]]:
    with SlowDisk() as disk:
        return [case_snapshot(root, disk, dp, tp, distributed) for dp, tp, distributed in CASES]


def test_async_saves_write_the_state_at_save_time_while_the_training_goes_on(tmp_path):
    ranks = run_distributed(grid, 2, tmp_path)
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
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
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
