"""``weights_only`` (the default) really refuses arbitrary objects in DCP folders: ``.metadata`` and byte entries.

Each crafted checkpoint carries a payload whose unpickling touches a marker file under ``tmp_path``. With the
default every reader (load, load_raw, inspect, convert) raises ``WeightsOnlyError`` and the marker never
appears; with ``weights_only=False`` the same reads go through and the marker appears, proving the payload real.
"""

from __future__ import annotations

import pathlib
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from modelpar._cli import main
from modelpar.checkpoint import Checkpointer, WeightsOnlyError, load_state, save_state
from modelpar.checkpoint._convert import convert_to_file
from modelpar.checkpoint._dcp_read import single_process
from modelpar.checkpoint._inspect import describe_checkpoint


class Touch:
    """Unpickles by calling ``pathlib.Path.touch(marker)``: a side effect any unrestricted unpickler runs."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.AdamW]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(3, 8)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def fresh() -> tuple[nn.Module, torch.optim.AdamW]:
    return trained(seed=1)


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "pwned"


@pytest.fixture
def evil_metadata(tmp_path: Path, marker: Path) -> Path:
    """A real model + AdamW folder whose ``.metadata`` pickle also holds a ``Touch`` payload."""
    model, optimizer = trained()
    folder = tmp_path / "evil_metadata"
    save_state(folder, {"model": model, "optimizer": optimizer}, full=False)
    with (folder / ".metadata").open("rb") as file:
        metadata = pickle.load(file)
    metadata.extra = Touch(marker)  # an attribute DCP never looks at: only its unpickling does anything
    with (folder / ".metadata").open("wb") as file:
        pickle.dump(metadata, file)
    assert not marker.exists()
    return folder


@pytest.fixture
def evil_bytes(tmp_path: Path, marker: Path) -> Path:
    """A real model + AdamW folder whose byte entry ``optimizer.param_groups.0.foreach`` unpickles a ``Touch``.

    ``Path.touch`` returns ``None``, AdamW's default ``foreach``: with ``weights_only=False`` it loads fine.
    """
    model, optimizer = trained()
    optimizer_state = get_optimizer_state_dict(model, optimizer)
    assert optimizer_state["param_groups"][0]["foreach"] is None
    optimizer_state["param_groups"][0]["foreach"] = Touch(marker)
    folder = tmp_path / "evil_bytes"
    with single_process():  # DCP by hand in one process, as modelpar's own one-process paths call it
        dcp.save(
            {"model": get_model_state_dict(model), "optimizer": optimizer_state}, checkpoint_id=folder, no_dist=True
        )
    assert not marker.exists()
    return folder


def assert_same_weights(a: nn.Module, b: nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), name


def test_legitimate_model_and_adamw_checkpoint_loads_inspects_and_converts_with_the_default(tmp_path: Path) -> None:
    model, optimizer = trained()
    folder = tmp_path / "ckpt"
    save_state(folder, {"model": model, "optimizer": optimizer, "step": 3, "note": {"a": [1, 2.0]}}, full=False)
    target, target_optimizer = fresh()
    state = {"model": target, "optimizer": target_optimizer, "step": 0, "note": None}
    load_state(folder, state)
    assert state["step"] == 3 and state["note"] == {"a": [1, 2.0]}
    assert_same_weights(model, target)
    assert target_optimizer.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    pairs = zip(model.parameters(), target.parameters(), strict=True)
    for saved, loaded in ((optimizer.state[p], target_optimizer.state[q]) for p, q in pairs):
        assert all(torch.equal(saved[k], loaded[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    raw = fresh()[0]
    Checkpointer().load_raw(folder, raw)
    assert_same_weights(model, raw)
    assert "model.0.weight" in describe_checkpoint(folder)
    convert_to_file(folder, tmp_path / "full.pt", progress=False)
    assert torch.equal(torch.load(tmp_path / "full.pt")["model"]["0.weight"], model[0].weight)


@pytest.mark.parametrize(
    "read",
    [
        pytest.param(lambda folder, out, **kw: load_state(folder, {"model": fresh()[0]}, **kw), id="load_state"),
        pytest.param(lambda folder, out, **kw: Checkpointer().load_raw(folder, fresh()[0], **kw), id="load_raw"),
        pytest.param(
            lambda folder, out, **kw: Checkpointer().load_trainer_checkpoint(folder, fresh()[0], [], **kw),
            id="load_trainer_checkpoint",
        ),
        pytest.param(lambda folder, out, **kw: describe_checkpoint(folder, **kw), id="inspect"),
        pytest.param(lambda folder, out, **kw: convert_to_file(folder, out, progress=False, **kw), id="convert"),
    ],
)
def test_metadata_with_a_foreign_object_is_refused_by_default_and_read_when_trusted(
    evil_metadata: Path, marker: Path, tmp_path: Path, read: Any
) -> None:
    out = tmp_path / "out.pt"
    with pytest.raises(WeightsOnlyError, match=r"\.metadata'.* holds `pathlib\.Path\.touch`.*`weights_only=False`"):
        read(evil_metadata, out)
    assert not marker.exists()
    assert not out.exists()
    try:
        read(evil_metadata, out, weights_only=False)
    except (KeyError, ValueError) as err:  # load_trainer_checkpoint: no "state_dict" model in this folder
        assert not isinstance(err, WeightsOnlyError)
    assert marker.exists()


def test_metadata_with_a_foreign_object_is_refused_by_the_command_line(
    evil_metadata: Path, marker: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(evil_metadata)]) == 2
    err = capsys.readouterr().err
    assert "pathlib.Path.touch" in err and "`--trust` is `weights_only=False`" in err
    assert not marker.exists()
    assert main(["inspect", "--trust", str(evil_metadata)]) == 0  # the payload is real: trusted, it runs
    assert marker.exists()


def test_byte_entry_with_a_foreign_object_is_refused_by_default_and_loaded_when_trusted(
    evil_bytes: Path, marker: Path
) -> None:
    target, target_optimizer = fresh()
    with pytest.raises(
        WeightsOnlyError,
        # torch.save writes Path.touch as getattr(Path, "touch"): the global torch's safe loader refuses.
        match=r"'optimizer\.param_groups\.0\.foreach' in '.*__0_0\.distcp' holds `getattr`.*`weights_only=False`",
    ):
        load_state(evil_bytes, {"model": target, "optimizer": target_optimizer})
    assert not marker.exists()
    load_state(evil_bytes, {"model": target, "optimizer": target_optimizer}, weights_only=False)
    assert marker.exists()
    assert_same_weights(trained()[0], target)


def test_byte_entry_with_a_foreign_object_is_refused_by_convert_and_converted_when_trusted(
    evil_bytes: Path, marker: Path, tmp_path: Path
) -> None:
    out = tmp_path / "full.pt"
    with pytest.raises(WeightsOnlyError, match=r"'optimizer\.param_groups\.0\.foreach'.*`getattr`"):
        convert_to_file(evil_bytes, out, progress=False)
    assert not marker.exists()
    assert not out.exists()
    convert_to_file(evil_bytes, out, progress=False, weights_only=False)
    assert marker.exists()
    assert out.is_file()


def test_byte_entries_are_not_unpickled_by_inspect_or_a_model_only_load(evil_bytes: Path, marker: Path) -> None:
    assert "non-tensor entries: 12" in describe_checkpoint(evil_bytes)
    model = fresh()[0]
    Checkpointer().load_raw(evil_bytes, model)
    assert_same_weights(trained()[0], model)
    assert not marker.exists()


def test_weights_only_error_is_a_value_error_and_an_unpickling_error(evil_metadata: Path) -> None:
    with pytest.raises(ValueError, match="refuses to unpickle"):
        describe_checkpoint(evil_metadata)
    with pytest.raises(pickle.UnpicklingError, match="refuses to unpickle"):
        describe_checkpoint(evil_metadata, weights_only=None)
