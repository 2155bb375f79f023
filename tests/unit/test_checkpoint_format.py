"""Checkpoint format detection and metadata restoring (no process group needed)."""

import pytest
import torch

from modelpar.checkpoint import CheckpointFormat, CheckpointKeyError, CheckpointNotFoundError, detect_format
from modelpar.checkpoint._state import restore_metadata, split_state


def test_detects_full_and_distributed_formats(tmp_path):
    (tmp_path / "full.pt").write_bytes(b"x")
    folder = tmp_path / "dist"
    folder.mkdir()
    (folder / ".metadata").write_bytes(b"x")
    assert detect_format(tmp_path / "full.pt") is CheckpointFormat.FULL
    assert detect_format(folder) is CheckpointFormat.DISTRIBUTED


def test_missing_path_and_plain_folder_are_named(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"No checkpoint at '.*nope': the path does not exist"):
        detect_format(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"does not point to a valid checkpoint: it has no '\.metadata' file"):
        detect_format(tmp_path)


class Counter:
    def __init__(self):
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, sd):
        self.n = sd["n"]


def test_stateful_objects_are_restored_in_place_and_the_rest_returned():
    counter = Counter()
    state = {"counter": counter, "step": 0}
    remainder = restore_metadata(
        {"counter": counter, "step": 0}, state, {"counter": {"n": 7}, "step": 5, "x": 1}, True, "p"
    )
    assert state["counter"] is counter and counter.n == 7 and state["step"] == 5
    assert remainder == {"x": 1}


def test_strict_metadata_loading_names_the_missing_key():
    with pytest.raises(
        CheckpointKeyError, match=r"The requested state contains a key 'epoch' that does not exist in the checkpoint"
    ):
        restore_metadata({"epoch": 0}, {"epoch": 0}, {"step": 1}, True, "ckpt")
    assert restore_metadata({"epoch": 0}, {"epoch": 0}, {"step": 1}, False, "ckpt") == {"step": 1}


def test_an_optimizer_without_its_model_is_explained():
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer under key 'opt' holds none of the parameters of the 1 known"):
        split_state({"model": model, "opt": opt})
    assert split_state({"opt": opt}, known_modules=[other]).optimizers["opt"][1] is other
