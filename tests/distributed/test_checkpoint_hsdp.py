"""Checkpoints on HSDP meshes: loading, saving and resharding, exact, in both formats.

The truth is the single-process model of ``test_checkpoint.py``, trained two AdamW steps and saved with no
process group, as a folder ("1p") and as one file ("1p.pt"). One spawn of 4 processes as two nodes:

* both HSDP layouts, 2x2x1 and 2x1x2 (replicate x shard x tensor parallel), load both sources; the weights and
  Adam moments they hold, gathered, must equal the truth bit for bit;
* each HSDP layout saves in both formats; the 2-D 2x2 layout loads every one of them, and the other HSDP
  layout each folder, again exactly;
* the same model is saved as a folder from 2x2x1 and from 4x1 (2-D): a replica holds the same shards as its
  peer, so DCP must write each tensor's bytes once. Every byte in the HSDP shard files belongs to an entry
  of the index, the tensor bytes are those of 4x1, and so is the overhead per item written (a replica that
  wrote its copy too would double the bytes in the files; the index keeps one entry per piece).

In the test process, without any process group, every HSDP checkpoint loads into a plain module (through
``load_state``, and the full files through plain ``torch.load`` too) and equals the truth.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import LR, fresh, gathered, trained_reference
from torch.distributed.checkpoint import FileSystemReader, TensorStorageMetadata

from harness import run_distributed
from modelpar.checkpoint import load_state, save_state
from parity import adamw, make_fabric, reference_model

#: name -> (data_parallel_size, tensor_parallel_size, data_parallel_replicate_size)
HSDP = {"2x2x1": (4, 1, 2), "2x1x2": (2, 2, 2)}
TWO_D = {"2x2": (2, 2, 1), "4x1": (4, 1, 1)}
FORMATS = {"dist": True, "full": False}


@cache
def _truth() -> tuple[dict[str, Any], dict[str, Any]]:
    """The truth's weights and optimizer state, keyed by name; computed once per process."""
    return gathered(*trained_reference())


def assert_same_as_truth(model: Any, opt: Any, where: str) -> None:
    """``test_checkpoint.assert_same_as_truth``, with the truth trained once per process, not once per check."""
    want_model, want_opt = _truth()
    got_model, got_opt = gathered(model, opt)
    torch.testing.assert_close(got_model, want_model, atol=0, rtol=0, msg=lambda m: f"{where} model: {m}")
    torch.testing.assert_close(got_opt["state"], want_opt["state"], atol=0, rtol=0, msg=lambda m: f"{where}: {m}")


def _path(root: Path, name: str, fmt: str) -> Path:
    return root / (name if fmt == "dist" else f"{name}.pt")


def _fabric(layout: str, fmt: str) -> Any:
    dp, tp, replicate = {**HSDP, **TWO_D}[layout]
    fabric = make_fabric(
        dp,
        tp,
        world_size=4,
        num_nodes=2,
        data_parallel_replicate_size=replicate,
        save_distributed_checkpoint=fmt == "dist",
    )
    assert tuple(fabric.strategy.device_mesh.shape) == tuple(int(n) for n in layout.split("x"))
    return fabric


def _load(fabric: Any, source: Path, layout: str) -> tuple[Any, Any]:
    """A fresh model + optimizer (from another seed, with state) on ``fabric``, loaded from ``source`` and checked."""
    model, opt = fresh(fabric)
    state = {"model": model, "optimizer": opt, "step": 0}
    fabric.load(source, state)
    assert state["step"] == 2
    assert_same_as_truth(model, opt, f"{source.name} -> {layout}")
    return model, opt


def grid(root: Path) -> dict[str, Any]:
    loaded, fabrics = [], {}
    # the single-process truth into each HSDP layout, both formats; each layout re-saves in the format it loaded
    for layout in HSDP:
        for fmt in FORMATS:
            fabric = _fabric(layout, fmt)
            model, opt = _load(fabric, _path(root, "1p", fmt), layout)
            loaded.append(f"1p-{fmt}->{layout}")
            fabric.save(_path(root, layout, fmt), {"model": model, "optimizer": opt, "step": 2})
            fabrics[layout] = fabric
    # HSDP checkpoints into the 2-D 2x2 layout (both formats), and into the other HSDP layout
    two_d = _fabric("2x2", "dist")
    for src in HSDP:
        for fmt in FORMATS:
            _load(two_d, _path(root, src, fmt), "2x2")
            loaded.append(f"{src}-{fmt}->2x2")
        other = next(layout for layout in HSDP if layout != src)
        _load(fabrics[other], _path(root, src, "dist"), other)
        loaded.append(f"{src}-dist->{other}")
    # the same model written from 4x1 (2-D), to compare the bytes written with 2x2x1's
    fabric = _fabric("4x1", "dist")
    model, opt = _load(fabric, _path(root, "1p", "dist"), "4x1")
    fabric.save(_path(root, "4x1", "dist"), {"model": model, "optimizer": opt, "step": 2})
    return {"loaded": loaded}


@pytest.fixture(scope="module")
def hsdp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("ckpt-hsdp")
    model, opt = trained_reference()
    for fmt, distributed in FORMATS.items():  # no process group
        save_state(_path(root, "1p", fmt), {"model": model, "optimizer": opt, "step": 2}, full=not distributed)
    return {"root": root, "results": run_distributed(grid, 4, root, nodes=2, timeout=180)}


def test_single_process_checkpoints_load_exactly_into_both_hsdp_layouts_in_both_formats(hsdp):
    loaded = set(hsdp["results"][0]["loaded"])
    assert {f"1p-{fmt}->{layout}" for fmt in FORMATS for layout in HSDP} <= loaded
    assert all(set(r["loaded"]) == loaded for r in hsdp["results"])


def test_hsdp_checkpoints_reshard_exactly_into_the_other_hsdp_layout_and_a_2d_layout(hsdp):
    loaded = set(hsdp["results"][0]["loaded"])
    want = {f"{src}-{fmt}->2x2" for src in HSDP for fmt in FORMATS} | {"2x2x1-dist->2x1x2", "2x1x2-dist->2x2x1"}
    assert want <= loaded, want - loaded


@pytest.mark.parametrize("layout", list(HSDP))
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_hsdp_checkpoints_load_exactly_into_one_process_without_a_process_group(hsdp, layout, fmt):
    path = _path(hsdp["root"], layout, fmt)
    assert path.is_dir() if fmt == "dist" else path.is_file()
    model = reference_model(seed=7)
    opt = adamw(model.parameters(), lr=LR)
    state = {"model": model, "optimizer": opt, "step": 0}
    load_state(path, state)
    assert state["step"] == 2
    assert_same_as_truth(model, opt, f"{layout} ({fmt}) -> 1 process")
    if fmt == "full":  # a plain torch file keyed by parameter name, as from a 2-D layout
        raw = torch.load(path, weights_only=True)
        assert set(raw) == {"model", "optimizer", "step"}
        assert "layers.0.attention.wq.weight" in raw["optimizer"]["state"]
        torch.testing.assert_close(raw["model"], trained_reference()[0].state_dict(), atol=0, rtol=0)


def _written(folder: Path) -> dict[str, int]:
    """Bytes in the shard files; bytes and items the folder's index points to; tensor bytes, each element once."""
    metadata = FileSystemReader(folder).read_metadata()
    tensors = [m for m in metadata.state_dict_metadata.values() if isinstance(m, TensorStorageMetadata)]
    return {
        "files": sum(p.stat().st_size for p in folder.glob("*.distcp")),
        "indexed": sum(item.length for item in metadata.storage_data.values()),
        "items": len(metadata.storage_data),
        "payload": sum(m.size.numel() * m.properties.dtype.itemsize for m in tensors),
    }


def test_distributed_checkpoints_from_hsdp_store_each_tensor_once_not_once_per_replica(hsdp):
    """Each replica holds the same shards; only one of them may write them.

    Every item DCP writes is serialized with a header of its own (about 1.5 kB here, as much as a small
    tensor), and 4x1 cuts every tensor into 4 pieces where 2x2x1 cuts it into 2, so the raw folder sizes
    differ for that reason alone: the bytes are compared per item and net of the tensor data.
    """
    flat = _written(hsdp["root"] / "4x1")
    for layout in HSDP:
        got = _written(hsdp["root"] / layout)
        # a replica writing its copy too would put bytes in the files that no index entry points to
        assert got["files"] == got["indexed"], (layout, got)
        assert got["payload"] == flat["payload"], (layout, got, flat)
        # what is not tensor data is the same per item as from 4x1 (about three times as much, with duplicates)
        per_item, flat_per_item = ((w["files"] - w["payload"]) / w["items"] for w in (got, flat))
        assert abs(per_item - flat_per_item) < 0.1 * flat_per_item, (layout, got, flat)
        assert got["files"] <= 1.05 * flat["files"], (layout, got, flat)  # about equal (fewer pieces), not 2x
