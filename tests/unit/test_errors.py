"""Our errors are caught by the ``except`` clauses written for Lightning's and torch's, and by the natural ones.

Each situation is provoked for real (no process group: a plain module, files written here) and, where it can
be without a process group, Lightning's or torch's own code is run on the same situation, so the test states
"ours is a subclass of what they raise", not a type copied from their source.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import pytest
import torch
from lightning_fabric.strategies.model_parallel import (
    _load_raw_module_state,
    _load_raw_module_state_from_path,
    _setup_device_mesh,
)
from lightning_fabric.strategies.strategy import _validate_keys_for_strict_loading
from torch import nn

import modelpar
import modelpar.checkpoint
from modelpar import (
    CheckpointKeyError,
    CheckpointNotFoundError,
    CheckpointShapeError,
    CorruptCheckpointError,
    MeshLayout,
    MeshSizeError,
    ModelParallelStrategy,
    UnsupportedReduceOpError,
    UnsupportedStyleError,
    WeightsOnlyError,
)
from modelpar.checkpoint import Checkpointer, load_state, save_state

HIERARCHY = [
    (MeshSizeError, (ValueError, RuntimeError)),
    (CheckpointNotFoundError, (FileNotFoundError, OSError, ValueError)),
    (CheckpointKeyError, (KeyError, LookupError, RuntimeError)),
    (CheckpointShapeError, (ValueError, RuntimeError)),
    (CorruptCheckpointError, (ValueError, RuntimeError)),
    (WeightsOnlyError, (ValueError, pickle.UnpicklingError)),
    (UnsupportedReduceOpError, (ValueError, AttributeError)),
    (UnsupportedStyleError, (TypeError, NotImplementedError)),
]


def raised(fn: Callable[[], object]) -> BaseException:
    with pytest.raises(BaseException) as info:
        fn()
    return info.value


def model(*sizes: int) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(a, b) for a, b in pairwise(sizes)))


def identity(module, mesh):
    return module


@pytest.mark.parametrize(("cls", "bases"), HIERARCHY, ids=lambda v: getattr(v, "__name__", ""))
def test_each_error_derives_from_the_types_users_already_catch(cls, bases):
    assert issubclass(cls, bases)
    err = cls("what is wrong, the values, the fix: 'x'")
    assert all(isinstance(err, base) for base in bases)
    assert str(err) == "what is wrong, the values, the fix: 'x'"  # no quotes, even from KeyError
    again = pickle.loads(pickle.dumps(err))  # errors cross process boundaries in launchers and harnesses
    assert type(again) is cls and str(again) == str(err)


def test_the_errors_are_public_where_users_look_for_them():
    names = {cls.__name__ for cls, _ in HIERARCHY}
    assert names <= set(modelpar.__all__)
    checkpoint_names = {n for n in names if "Checkpoint" in n or n == "WeightsOnlyError"}
    assert checkpoint_names <= set(modelpar.checkpoint.__all__)
    assert all(getattr(modelpar.checkpoint, n) is getattr(modelpar, n) for n in checkpoint_names)


def test_a_key_error_prints_its_message_without_quotes():
    err = CheckpointKeyError("The checkpoint 'a.pt' has no entry 'model'.")
    assert str(err) == "The checkpoint 'a.pt' has no entry 'model'."
    assert str(KeyError("plain")) == "'plain'"  # what the override avoids


# -- mesh sizes ----------------------------------------------------------------------------------------


def test_sizes_whose_product_is_not_the_world_size_raise_what_lightning_raises():
    theirs = raised(lambda: _setup_device_mesh(3, 2, 4, torch.device("cpu")))
    ours = raised(lambda: MeshLayout.resolve(3, 2, world_size=4, num_nodes=1, devices_per_node=4))
    assert type(theirs) is RuntimeError and isinstance(ours, RuntimeError) and isinstance(ours, MeshSizeError)
    # Lightning's words for it are in ours too, for code (and tests) that match them
    assert "multiplied should equal the world size" in str(theirs) and "multiplied should equal" in str(ours)
    message = r"should equal the world size \(4\), but `data_parallel_size=3` x `tensor_parallel_size=2` = 6\."
    with pytest.raises(RuntimeError, match=message):
        MeshLayout.resolve(3, 2, world_size=4, num_nodes=1, devices_per_node=4)
    with pytest.raises(ValueError, match=message):
        MeshLayout.resolve(3, 2, world_size=4, num_nodes=1, devices_per_node=4)


@pytest.mark.parametrize(
    ("dp", "tp", "nodes", "per_node", "message"),
    [
        ("auto", "auto", 2, 4, r"number of nodes \(2\) x devices per node \(4\) = 8, but the world size is 4"),
        (3, "auto", 1, 4, r"`data_parallel_size=3` with `tensor_parallel_size=\"auto\"` needs 3 to divide"),
        ("auto", 0, 1, 4, r"`tensor_parallel_size=0` is not a valid size"),
    ],
)
def test_auto_and_invalid_sizes_are_runtime_errors_as_well(dp, tp, nodes, per_node, message):
    with pytest.raises(RuntimeError, match=message):
        MeshLayout.resolve(dp, tp, world_size=4, num_nodes=nodes, devices_per_node=per_node)
    with pytest.raises(ValueError, match=message):
        MeshLayout.resolve(dp, tp, world_size=4, num_nodes=nodes, devices_per_node=per_node)


def test_an_invalid_size_at_construction_is_a_mesh_size_error():
    with pytest.raises(MeshSizeError, match=r"`data_parallel_size=0` is not a valid size"):
        ModelParallelStrategy(identity, data_parallel_size=0)


# -- checkpoints ---------------------------------------------------------------------------------------


def test_a_missing_path_is_a_file_not_found_error_and_the_value_error_lightning_raises(tmp_path: Path):
    missing = tmp_path / "nope.pt"
    lightning = raised(lambda: _load_raw_module_state_from_path(missing, model(4, 3), world_size=1))
    torch_load = raised(lambda: torch.load(missing, weights_only=True))
    for load in (
        lambda: Checkpointer().load_raw(missing, model(4, 3)),
        lambda: load_state(missing, {"model": model(4, 3)}),
    ):
        ours = raised(load)
        assert isinstance(ours, type(lightning)) and isinstance(ours, type(torch_load))
        assert isinstance(ours, CheckpointNotFoundError)
        with pytest.raises(FileNotFoundError, match=r"No checkpoint at '.*nope\.pt': the path does not exist"):
            load()
        with pytest.raises(ValueError, match=r"No checkpoint at '.*nope\.pt': the path does not exist"):
            load()


def test_a_raw_state_dict_with_a_missing_key_fails_like_load_state_dict(tmp_path: Path):
    path = tmp_path / "raw.pt"
    torch.save(model(4, 3).state_dict(), path)
    bigger = model(4, 3, 2)
    theirs = raised(lambda: _load_raw_module_state(torch.load(path, weights_only=True), bigger))
    ours = raised(lambda: Checkpointer().load_raw(path, bigger))
    assert type(theirs) is RuntimeError and isinstance(ours, RuntimeError) and isinstance(ours, KeyError)
    assert str(ours).startswith("The model contains a key '1.weight' that does not exist in '")
    assert "2 missing (e.g. ['1.weight', '1.bias'])" in str(ours)
    with pytest.raises(RuntimeError, match=r"does not match the model, 2 missing .* Pass `strict=False`"):
        Checkpointer().load_raw(path, bigger)
    with pytest.raises(KeyError, match=r"does not match the model, 2 missing .* Pass `strict=False`"):
        Checkpointer().load_raw(path, bigger)
    Checkpointer().load_raw(path, bigger, strict=False)  # the matching entries only


def test_a_raw_state_dict_with_a_wrong_shape_fails_like_load_state_dict(tmp_path: Path):
    path = tmp_path / "raw.pt"
    torch.save(model(4, 3).state_dict(), path)
    wider = model(4, 5)
    theirs = raised(lambda: _load_raw_module_state(torch.load(path, weights_only=True), wider))
    ours = raised(lambda: Checkpointer().load_raw(path, wider))
    assert type(theirs) is RuntimeError and isinstance(ours, RuntimeError) and isinstance(ours, CheckpointShapeError)
    message = r"Shape mismatch for '0.weight' in '.*raw\.pt': the checkpoint has \(3, 4\), the model expects \(5, 4\)"
    with pytest.raises(RuntimeError, match=message):
        Checkpointer().load_raw(path, wider)
    with pytest.raises(ValueError, match=message):
        Checkpointer().load_raw(path, wider)


@pytest.mark.parametrize("full", [True, False], ids=["file", "folder"])
def test_strict_loads_of_either_format_raise_key_and_shape_errors_that_are_runtime_errors(tmp_path: Path, full):
    path = tmp_path / "ckpt"
    save_state(path, {"model": model(4, 3), "step": 1}, full=full)
    with pytest.raises(RuntimeError, match=r"'1\.weight'"):
        load_state(path, {"model": model(4, 3, 2)})
    with pytest.raises(KeyError, match=r"'1\.weight'"):
        load_state(path, {"model": model(4, 3, 2)})
    with pytest.raises(RuntimeError, match=r"Shape mismatch for '0\.weight'"):
        load_state(path, {"model": model(4, 5)})
    with pytest.raises(ValueError, match=r"Shape mismatch for '0\.weight'"):
        load_state(path, {"model": model(4, 5)})
    with pytest.raises(
        KeyError, match=r"(requested state|model 'other') contains a key '\S+' that does not exist in the checkpoint"
    ):
        load_state(path, {"model": model(4, 3), "other": model(4, 3)})


def test_a_missing_metadata_key_raises_what_lightnings_strict_check_raises(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    save_state(path, {"model": model(4, 3), "step": 1}, full=True)
    theirs = raised(lambda: _validate_keys_for_strict_loading(["epoch"], ["step"], strict=True))
    ours = raised(lambda: load_state(path, {"model": model(4, 3), "epoch": 0}))
    assert type(theirs) is KeyError and isinstance(ours, KeyError) and isinstance(ours, RuntimeError)
    assert str(ours).startswith("The requested state contains")  # a message, not a quoted repr
    # in Lightning's words, then which checkpoint, what it has and the fix
    assert str(theirs).strip('"').startswith("The requested state contains a key 'epoch' that does not exist")
    with pytest.raises(
        KeyError, match=r"The requested state contains a key 'epoch' that does not exist in the checkpoint"
    ):
        load_state(path, {"model": model(4, 3), "epoch": 0})


def test_a_truncated_file_raises_what_torch_load_raises(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    save_state(path, {"model": model(4, 3)}, full=True)
    data = path.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    truncated = tmp_path / "truncated.pt"
    theirs = raised(lambda: torch.load(truncated, mmap=True, map_location="cpu", weights_only=True))
    ours = raised(lambda: load_state(truncated, {"model": model(4, 3)}))
    assert type(theirs) is RuntimeError and isinstance(ours, RuntimeError) and isinstance(ours, CorruptCheckpointError)
    with pytest.raises(RuntimeError, match=r"truncated\.pt' cannot be read: it is truncated, corrupt"):
        load_state(truncated, {"model": model(4, 3)})
    with pytest.raises(ValueError, match=r"truncated\.pt' cannot be read: it is truncated, corrupt"):
        load_state(truncated, {"model": model(4, 3)})


class Tag:
    """Not on torch's list of safe globals: ``weights_only=True`` refuses to unpickle it."""


def test_objects_refused_by_weights_only_raise_what_torch_load_raises(tmp_path: Path):
    path = tmp_path / "ckpt.pt"
    save_state(path, {"model": model(4, 3), "tag": Tag()}, full=True)
    theirs = raised(lambda: torch.load(path, mmap=True, map_location="cpu", weights_only=True))
    ours = raised(lambda: load_state(path, {"model": model(4, 3), "tag": None}))
    assert type(theirs) is pickle.UnpicklingError and isinstance(ours, pickle.UnpicklingError)
    with pytest.raises(pickle.UnpicklingError, match=r"holds `test_errors\.Tag`, which loading with `weights_only"):
        load_state(path, {"model": model(4, 3), "tag": None})
    with pytest.raises(ValueError, match=r"holds `test_errors\.Tag`, which loading with `weights_only=True`"):
        load_state(path, {"model": model(4, 3), "tag": None})
