"""A save killed midway leaves the previous checkpoint at the path, intact and loadable.

Two real processes save version 1, then start saving version 2 of a model large enough that the write
takes a while; the test SIGKILLs both as soon as the staging entry of version 2 appears on disk. Then a
plain single process loads the path and must find version 1, exactly.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from harness import run_and_kill_when
from modelpar.checkpoint import load_state, save_state
from modelpar.models import Llama, LlamaConfig
from parity import make_fabric

BIG = LlamaConfig(vocab_size=8192, dim=512, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=1536, max_seq_len=16)


def big_model() -> Llama:
    torch.manual_seed(0)
    return Llama(BIG)


def save_v1_then_v2(root: Path, distributed: bool) -> None:
    fabric = make_fabric(2, 1, world_size=2, save_distributed_checkpoint=distributed)
    model = fabric.setup_module(copy.deepcopy(big_model()))
    fabric.save(root / "ckpt", {"model": model, "version": 1})
    if fabric.global_rank == 0:
        (root / "v1-done").touch()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(2)
    for _ in range(20):  # keep saving v2; the test kills us during one of these saves
        fabric.save(root / "ckpt", {"model": model, "version": 2})


@pytest.mark.parametrize("distributed", [True, False], ids=["distributed", "full"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, distributed):
    def v2_in_progress() -> bool:
        return (tmp_path / "v1-done").exists() and any(tmp_path.glob(".ckpt.partial-*"))

    run_and_kill_when(save_v1_then_v2, 2, tmp_path, distributed, condition=v2_in_progress)

    assert any(tmp_path.glob(".ckpt.partial-*")), "the kill should have left an incomplete save behind"
    loaded = Llama(BIG)
    state = {"model": loaded, "version": 0}
    load_state(tmp_path / "ckpt", state)
    assert state["version"] == 1
    torch.testing.assert_close(loaded.state_dict(), big_model().state_dict(), atol=0, rtol=0)

    partial = next(tmp_path.glob(".ckpt.partial-*"))
    if distributed:  # pointing at the leftover itself says what it is
        with pytest.raises(ValueError, match=r"(incomplete|does not point to a valid checkpoint)"):
            load_state(partial, {"model": Llama(BIG)})

    # the next save to the same path clears the leftovers
    save_state(tmp_path / "ckpt", {"model": loaded, "version": 3}, full=not distributed)
    assert not any(tmp_path.glob(".ckpt.partial-*")) and not any(tmp_path.glob(".ckpt.old-*"))


def test_missing_path_mentions_an_interrupted_save_beside_it(tmp_path):
    (tmp_path / ".ckpt.partial-abc123").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at .*An incomplete save .*\.ckpt\.partial-abc123"):
        load_state(tmp_path / "ckpt", {"model": Llama(BIG)})


def test_saving_over_a_folder_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(IsADirectoryError, match=r"the path exists and is a directory that is not a checkpoint"):
        save_state(tmp_path / "precious", {"model": torch.nn.Linear(2, 2)}, full=True)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
