"""Checkpoints at URLs, on a real S3-compatible server on 127.0.0.1 (see ``object_store``), on real process groups.

The same truth as ``test_checkpoint``: a single-process checkpoint saved to the bucket, loaded and re-saved
by every 4-process layout, one of those loaded by all three (resharding; ``test_checkpoint`` reshards every
pair of 2- and 4-process layouts in local folders),
the full format, async saves, and the commit protocol seen from outside (markers, an interrupted save
treated as absent, a save killed mid-upload leaving the previous checkpoint the newest complete one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_checkpoint import (
    _load_all_then_save,
    _weights,
    assert_same_as_truth,
    case_async_snapshots,
    fresh,
    trained_reference,
)

from harness import run_distributed
from modelpar import CheckpointNotFoundError
from modelpar.checkpoint import describe_checkpoint, load_state, save_state
from modelpar.checkpoint._remote import RemotePath, to_location
from parity import adamw, make_fabric, reference_model

ROOT = Path(__file__).resolve().parents[2]


def no_retries() -> dict[str, Any]:
    """botocore options for an unreachable endpoint: its default retries take about 11 s per request to give up,
    one try 0.7 s. A fresh dict each time: botocore rewrites the one it is given."""
    return {"connect_timeout": 1, "retries": {"max_attempts": 1}}


def _root(url: str) -> RemotePath:
    root = to_location(url)
    assert isinstance(root, RemotePath)
    return root


def remote_four(url: str) -> dict[str, Any]:
    root = _root(url)
    out: dict[str, Any] = {"loaded": _load_all_then_save(root, 4, ["1p"], save=True)}
    out["cross"] = _load_all_then_save(root, 4, ["4x1"], save=False)
    names = {entry.name for entry in (root / "2x2").iterdir()}
    out["markers"] = [".modelpar-complete" in names, ".modelpar-writing" in names]
    out.update(_full_and_swap(root), **case_async_snapshots(root), **_errors(root), **_async_upload_error(root))
    return out


def _full_and_swap(root: RemotePath) -> dict[str, Any]:
    fabric = make_fabric(2, 2, world_size=4, num_nodes=2, save_distributed_checkpoint=False)
    model, opt = fresh(fabric)
    fabric.load(root / "2x2", {"model": model, "optimizer": opt})
    fabric.save(root / "full.pt", {"model": model, "optimizer": opt, "step": 2})
    model2, opt2 = fresh(fabric)
    state = {"model": model2, "optimizer": opt2, "step": 0}
    fabric.load(root / "full.pt", state)
    assert state["step"] == 2
    assert_same_as_truth(model2, opt2, "full.pt at a URL -> 2x2")
    # a folder and a file replace each other at the same URL
    fabric.strategy._core.save_distributed_checkpoint = True
    fabric.save(root / "swap", {"model": model})
    fabric.strategy._core.save_distributed_checkpoint = False
    fabric.save(root / "swap", {"model": model})
    to_file = (root / "swap").is_file()
    fabric.strategy._core.save_distributed_checkpoint = True
    fabric.save(root / "swap", {"model": model})
    to_folder = (root / "swap" / ".modelpar-complete").is_file() and not (root / "swap").is_file()
    model3, _ = fresh(fabric)
    fabric.load(root / "swap", {"model": model3})
    assert all(torch.equal(a, b) for a, b in zip(_weights(model3).values(), _weights(model).values(), strict=True))
    return {"swap": [to_file, to_folder]}


def _errors(root: RemotePath) -> dict[str, Any]:
    fabric = make_fabric(2, 2, world_size=4, num_nodes=2)
    model, _ = fresh(fabric)
    # an interrupted save (the writing marker without the commit) is absent, on every rank, and says so
    partial = root / "interrupted"
    fabric.save(partial, {"model": model})
    if dist.get_rank() == 0:  # as a save killed before its commit leaves it
        (partial / ".modelpar-complete").remove()
        (partial / ".modelpar-writing").write_bytes(b"{}")
        (root / "user-files" / "notes.txt").write_bytes(b"mine")
    dist.barrier()
    with pytest.raises(CheckpointNotFoundError, match=r"interrupted.*treated as absent"):
        fabric.load(root / "interrupted", {"model": model})
    # a prefix of the user's own objects is not replaced
    with pytest.raises(IsADirectoryError, match=r"Refusing to save to 's3://.*user-files'.*'notes.txt'"):
        fabric.save(root / "user-files", {"model": model})
    # storage_options are for URLs; an unreachable endpoint fails on every rank
    with pytest.raises(TypeError, match=r"not supported for the local path.*applies to URLs"):
        fabric.strategy.save_checkpoint("local-folder", {"model": model}, storage_options={"anon": True})
    unreachable = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": no_retries()}
    with pytest.raises(Exception, match=r"127\.0\.0\.1:9"):  # storage_options reach fsspec; rank 0's error, everywhere
        fabric.strategy.save_checkpoint(f"{root}/unreachable", {"model": model}, storage_options=unreachable)
    return {"errors": True}


def _async_upload_error(root: RemotePath) -> dict[str, Any]:
    """One rank's background upload fails (its own, unreachable endpoint): every rank raises at the next wait."""
    bad = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "config_kwargs": no_retries()}
    fabric = make_fabric(
        2, 2, world_size=4, num_nodes=2, async_save=True, storage_options=bad if dist.get_rank() == 1 else None
    )
    model, opt = fresh(fabric)
    fabric.save(root / "async-bad", {"model": model, "optimizer": opt})  # returns once staged; uploads go on
    with pytest.raises(BaseException, match=r"127\.0\.0\.1:9"):  # DCP's CheckpointException is a BaseException
        fabric.strategy._core.checkpointer.wait()
    committed = (root / "async-bad" / ".modelpar-complete").exists() if dist.get_rank() == 0 else False
    return {"async_error": not committed}


@pytest.fixture(scope="module")
def remote(s3_server: Any) -> dict[str, Any]:
    url = s3_server.new_bucket() + "/ckpt"
    model, opt = trained_reference()
    save_state(f"{url}/1p", {"model": model, "optimizer": opt, "step": 2}, full=False)  # no process group
    return {"url": url, "four": run_distributed(remote_four, 4, url, nodes=2)}


def test_checkpoints_at_a_url_reshard_between_layouts_in_both_formats(remote):
    # Every pair of layouts is resharded in test_checkpoint (local folders: the same code past the I/O layer);
    # here a one-process checkpoint goes into each 4-process layout, and one of them back into all three.
    pairs = set(remote["four"][0]["loaded"]) | set(remote["four"][0]["cross"])
    assert {p.split("->")[0] for p in pairs} == {"1p", "4x1"}
    assert {p.split("->")[1] for p in pairs} == {"2x2", "4x1", "1x4"}
    assert len(pairs) == 3 + 3
    four = remote["four"][0]
    assert four["markers"] == [True, False]  # committed: the commit marker, and no writing marker left
    assert four["swap"] == [True, True]
    assert four["async_dist"] and four["async_full"] and four["errors"] and four["async_error"]


def test_a_url_checkpoint_loads_in_one_process_and_is_described_offline(remote):
    model = reference_model(seed=7)
    opt = adamw(model.parameters())
    load_state(f"{remote['url']}/2x2", {"model": model, "optimizer": opt})
    truth, _ = trained_reference()
    torch.testing.assert_close(model.state_dict(), truth.state_dict(), atol=0, rtol=0)
    text = describe_checkpoint(f"{remote['url']}/1x4")
    assert text.startswith(f"format: distributed ('{remote['url']}/1x4')") and "optimizer." in text


def test_the_cli_converts_between_a_url_and_a_local_file_both_ways(remote, tmp_path, program_python):
    local = tmp_path / "full.pt"
    cli = [program_python, "-m", "modelpar", "convert"]
    subprocess.run([*cli, f"{remote['url']}/2x2", str(local), "--to", "file"], check=True, env=os.environ)
    back = f"{remote['url']}/from-file"
    subprocess.run([*cli, str(local), back, "--to", "distributed"], check=True, env=os.environ)
    model = reference_model(seed=7)
    load_state(back, {"model": model})
    torch.testing.assert_close(model.state_dict(), trained_reference()[0].state_dict(), atol=0, rtol=0)
    assert (_root(back) / ".modelpar-complete").is_file()


def test_urls_are_kept_whole_and_a_missing_implementation_names_the_extra(tmp_path):
    assert to_location(f"file://{tmp_path}/a") == tmp_path / "a"  # local: the atomic local code path
    assert str(to_location("memory://bucket/run/step-5")) == "memory://bucket/run/step-5"
    with pytest.raises(ImportError, match=r"gs:// URLs such as 'gs://b/ck' need `pip install 'modelpar\[gcs\]'`"):
        to_location("gs://b/ck")
    with pytest.raises(ValueError, match=r"'nope://b/ck' is not a URL fsspec knows"):
        to_location("nope://b/ck")


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    import torch
    from modelpar.checkpoint import save_state
    from modelpar.checkpoint._remote import to_location

    url = sys.argv[1]
    target = to_location(url)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])  # ~100 MB

    def kill_once_uploading():
        while not (target / ".modelpar-writing").exists():
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_once_uploading, daemon=True).start()
    save_state(url, {"model": model}, full=False)
    print("the save finished before the kill", flush=True)
    """
)


def test_a_save_killed_mid_upload_leaves_the_previous_checkpoint_the_newest_complete(
    s3_bucket, tmp_path, program_python
):
    previous, killed = f"{s3_bucket}/run/step-5", f"{s3_bucket}/run/step-10"
    model = reference_model(seed=3)
    save_state(previous, {"model": model, "step": 5}, full=False)
    script = tmp_path / "killed_save.py"
    script.write_text(_KILLED_SAVE)
    done = subprocess.run([program_python, str(script), killed], env=os.environ, capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr
    with pytest.raises(CheckpointNotFoundError, match="under way or was interrupted"):
        load_state(killed, {"model": torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])})
    fresh_model = reference_model(seed=7)
    state = {"model": fresh_model, "step": 0}
    load_state(previous, state)
    assert state["step"] == 5
    torch.testing.assert_close(fresh_model.state_dict(), model.state_dict(), atol=0, rtol=0)


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("cannot pickle this")


def test_a_full_save_that_fails_mid_write_leaves_the_previous_object_in_place(s3_bucket):
    url = f"{s3_bucket}/full.pt"
    model = reference_model(seed=3)
    save_state(url, {"model": model, "step": 1}, full=True)
    with pytest.raises(RuntimeError, match="cannot pickle this"):
        save_state(url, {"model": reference_model(seed=4), "bad": _Unpicklable()}, full=True)
    state = {"model": reference_model(seed=7), "step": 0}
    load_state(url, state)
    assert state["step"] == 1
    torch.testing.assert_close(state["model"].state_dict(), model.state_dict(), atol=0, rtol=0)


@pytest.mark.parametrize("full", [False, True], ids=["distributed", "full"])
def test_file_urls_round_trip_through_the_local_path_and_load_raw_reads_urls(tmp_path, s3_bucket, full):
    from modelpar.checkpoint import Checkpointer

    model = reference_model(seed=3)
    url = f"file://{tmp_path}/ck"
    save_state(url, {"model": model, "step": 4}, full=full)
    assert (tmp_path / "ck").is_dir() != full  # the local atomic path: a real folder or file, no 'file:' folder
    state = {"model": reference_model(seed=7), "step": 0}
    load_state(url, state)
    assert state["step"] == 4
    torch.testing.assert_close(state["model"].state_dict(), model.state_dict(), atol=0, rtol=0)
    if full:  # load_raw reads a raw state-dict file, or a model in a folder
        import fsspec

        with fsspec.open(f"{s3_bucket}/raw", "wb") as file:
            torch.save(model.state_dict(), file)
    else:
        save_state(f"{s3_bucket}/raw", {"model": model}, full=False)
    raw = reference_model(seed=7)
    Checkpointer().load_raw(f"{s3_bucket}/raw", raw)  # what fabric.load(path, module) calls
    torch.testing.assert_close(raw.state_dict(), model.state_dict(), atol=0, rtol=0)
