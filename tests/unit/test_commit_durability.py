"""Commits survive a power loss: every staged file is fsynced before the rename, the folder after it, and the
previous checkpoint is deleted only then (in the background, or written over by the next save to the path).

A power loss cannot be simulated in a test, so the order of the calls is checked instead: ``os.open``,
``os.fsync``, ``os.replace`` / ``os.rename`` and the removals are wrapped to record what they touch, on real
files under ``tmp_path``. No process group.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from modelpar.checkpoint import Checkpointer, load_state, save_state
from modelpar.checkpoint._commit import (
    Trash,
    commit,
    commit_among,
    new_token,
    remove_stale,
    reuse_as_staging,
    staging_path,
)

Event = tuple[str, Any]  # ("fsync", path), ("replace", (src, dst)), ("remove", path)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[Event]:
    """Every fsync (by the path its descriptor was opened on), rename and removal, in order."""
    events: list[Event] = []
    opened: dict[int, Path | None] = {}
    inside_rmtree = False
    real_open, real_close, real_fsync = os.open, os.close, os.fsync
    real_replace, real_rename = os.replace, os.rename
    real_unlink, real_rmtree = os.unlink, shutil.rmtree

    def absolute(path: Any, dir_fd: int | None) -> Path | None:
        return Path(path).absolute() if dir_fd is None else None

    def spy_open(path: Any, flags: int, *args: Any, dir_fd: int | None = None, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, dir_fd=dir_fd, **kwargs)
        opened[fd] = absolute(path, dir_fd)
        return fd

    def spy_close(fd: int) -> None:
        opened.pop(fd, None)
        real_close(fd)

    def spy_fsync(fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        real_fsync(fd)
        # Where the platform tells, ask it: descriptors from built-in open() (DCP's own fsyncs) are not tracked,
        # and their numbers may be ones os.open returned before.
        link = f"/proc/self/fd/{number}"
        events.append(("fsync", Path(os.readlink(link)) if os.path.islink(link) else opened.get(number)))

    def spy_replace(src: Any, dst: Any, **kwargs: Any) -> None:
        real_replace(src, dst, **kwargs)
        events.append(("replace", (Path(src).absolute(), Path(dst).absolute())))

    def spy_rename(src: Any, dst: Any, **kwargs: Any) -> None:
        real_rename(src, dst, **kwargs)
        events.append(("replace", (Path(src).absolute(), Path(dst).absolute())))

    def spy_unlink(path: Any, *, dir_fd: int | None = None) -> None:
        real_unlink(path, dir_fd=dir_fd)
        if not inside_rmtree:
            events.append(("remove", absolute(path, dir_fd)))

    def spy_rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
        nonlocal inside_rmtree
        inside_rmtree = True
        try:
            real_rmtree(path, *args, **kwargs)
        finally:
            inside_rmtree = False
        events.append(("remove", Path(path).absolute()))

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "close", spy_close)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    monkeypatch.setattr(os, "rename", spy_rename)
    monkeypatch.setattr(os, "unlink", spy_unlink)
    monkeypatch.setattr(os, "remove", spy_unlink)
    monkeypatch.setattr(shutil, "rmtree", spy_rmtree)
    return events


def make_entry(path: Path, kind: str, version: str) -> list[Path]:
    """A file checkpoint, or a folder laid out like DCP's plus meta.pt; returns the files relative to it."""
    if kind == "file":
        path.write_bytes(version.encode() * 1000)
        return [Path()]
    path.mkdir()
    names = ["__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"]
    for name in names:
        (path / name).write_bytes(f"{version}:{name}".encode() * 100)
    return [Path(name) for name in names]


def assert_durable_order(events: list[Event], staged: Path, target: Path, files: list[Path], old: bool) -> None:
    """fsync(each staged file) -> fsync(staged folder) -> renames -> fsync(parent) -> remove(old)."""
    moved = [i for i, (op, arg) in enumerate(events) if op == "replace" and arg == (staged, target)]
    assert len(moved) == 1, events
    rename = moved[0]
    synced_before = [arg for op, arg in events[:rename] if op == "fsync"]
    for relative in files:
        assert staged / relative in synced_before, (f"{relative} not fsynced before the rename", events)
    if files != [Path()]:  # a folder: its entries (the file names) are made durable too
        last_file = max(synced_before.index(staged / relative) for relative in files)
        assert staged in synced_before[last_file + 1 :], ("staged folder fsynced after its files", events)

    aside = [arg[1] for op, arg in events[:rename] if op == "replace" and arg[0] == target]
    assert len(aside) == (1 if old else 0), events
    parent_synced = [i for i, (op, arg) in enumerate(events) if op == "fsync" and arg == target.parent]
    assert parent_synced and parent_synced[0] > rename, ("parent folder fsynced after the rename", events)
    removals = [i for i, (op, _) in enumerate(events) if op == "remove"]
    if old:
        assert [events[i][1] for i in removals] == aside, events
        assert removals[0] > parent_synced[0], ("the old checkpoint is deleted only after the fsync", events)
        assert not aside[0].exists()
    else:
        assert removals == [], events


@pytest.mark.parametrize("old", [None, "file", "folder"], ids=["no-previous", "previous-file", "previous-folder"])
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_commit_fsyncs_staged_files_then_renames_then_fsyncs_the_folder_then_deletes_the_old(
    tmp_path, calls, kind, old
):
    target = tmp_path / "ckpt"
    if old:
        make_entry(target, old, "v1")
    token = new_token()
    staged = staging_path(target, token)
    files = make_entry(staged, kind, "v2")
    calls.clear()

    commit(target, staged, token)

    assert_durable_order(calls, staged.absolute(), target.absolute(), files, old=bool(old))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    for relative in files:
        assert (target / relative).read_bytes().startswith(b"v2")


def test_commit_raises_when_a_staged_file_cannot_be_made_durable_and_keeps_the_previous(
    tmp_path, monkeypatch: pytest.MonkeyPatch
):
    target = tmp_path / "ckpt"
    make_entry(target, "file", "v1")
    token = new_token()
    staged = staging_path(target, token)
    make_entry(staged, "file", "v2")

    def failing_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="Input/output error"):
        commit(target, staged, token)
    assert target.read_bytes().startswith(b"v1")


@pytest.mark.parametrize("full", [True, False], ids=["full", "distributed"])
@pytest.mark.parametrize("previous", [False, True], ids=["new", "over-previous"])
def test_a_save_fsyncs_every_file_it_wrote_before_renaming_it_into_place(tmp_path, calls, full, previous):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    target = tmp_path / "ckpt"
    if previous:
        save_state(target, {"model": model, "step": 0}, full=full)
    calls.clear()

    save_state(target, {"model": model, "optimizer": optimizer, "step": 1}, full=full)

    committed = [arg for op, arg in calls if op == "replace" and arg[1] == target.absolute()]
    assert len(committed) == 1, calls
    staged = committed[0][0]
    files = [Path()] if full else sorted(p.relative_to(target) for p in target.rglob("*") if p.is_file())
    if not full:
        assert {".metadata", "meta.pt"} <= {p.name for p in files} and any(p.suffix == ".distcp" for p in files)
    assert_durable_order(calls, staged, target.absolute(), files, old=previous)


def test_with_shards_synced_by_their_writers_the_commit_fsyncs_only_the_metadata_and_folders(tmp_path, calls):
    target = tmp_path / "ckpt"
    token = new_token()
    staged = staging_path(target, token)
    make_entry(staged, "folder", "v2")
    calls.clear()

    commit(target, staged, token, shards_synced=True)

    synced = [arg for op, arg in calls if op == "fsync"]
    staged = staged.absolute()
    assert not [p for p in synced if p.suffix == ".distcp"], synced  # each rank fsynced its own already
    assert set(synced[:2]) == {staged / ".metadata", staged / "meta.pt"}, synced
    assert synced[2:] == [staged, tmp_path.absolute()], synced  # the folder after its files, the parent last


def test_the_previous_checkpoint_goes_after_the_commit_and_a_crash_meanwhile_leaves_trash_the_next_save_removes(
    tmp_path,
):
    target = tmp_path / "ckpt"
    make_entry(target, "folder", "v1")
    token = new_token()
    staged = staging_path(target, token)
    make_entry(staged, "folder", "v2")
    handed: list[Path] = []

    commit(target, staged, token, discard=handed.append)  # a crash before the deletion: the old one is left

    assert (target / "meta.pt").read_bytes().startswith(b"v2")
    assert len(handed) == 1 and handed[0].name == f".ckpt.old-{token}" and handed[0].is_dir()
    remove_stale(target, busy=handed)  # being deleted by this process's trash: left to it
    assert handed[0].is_dir()
    remove_stale(target)  # the next save (of any process) removes what a crash left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_the_trash_deletes_in_the_background_and_wait_joins_it(tmp_path):
    trash = Trash()
    entries = [tmp_path / ".ckpt.old-a", tmp_path / ".ckpt.old-b"]
    make_entry(entries[0], "folder", "v1")
    make_entry(entries[1], "file", "v1")
    for entry in entries:
        trash.discard(entry)
    trash.wait()
    assert not any(entry.exists() for entry in entries) and trash.busy() == []
    trash.discard(tmp_path / "gone")  # a missing entry is no error
    trash.wait()


@pytest.mark.parametrize("before", ["empty", "meta-only", "shards-only", "previous"])
@pytest.mark.parametrize("full", [True, False], ids=["full", "distributed"])
def test_a_save_replaces_an_empty_folder_or_a_checkpoint_folder_atomically(tmp_path, full, before):
    target = tmp_path / "ckpt"
    target.mkdir()
    if before == "meta-only":
        torch.save({"step": -1}, target / "meta.pt")
    elif before == "shards-only":  # a save (Lightning's, or DCP's) that stopped before its .metadata
        (target / "__0_0.distcp").write_bytes(b"partial")
    elif before == "previous":
        shutil.rmtree(target)
        save_state(target, {"model": torch.nn.Linear(2, 2), "step": 0}, full=False)
    model = torch.nn.Linear(2, 2)

    save_state(target, {"model": model, "step": 1}, full=full)

    state = {"model": torch.nn.Linear(2, 2), "step": 0}
    load_state(target, state)
    assert state["step"] == 1 and torch.equal(state["model"].weight, model.weight)
    assert target.is_file() == full and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_full_save_refuses_a_folder_of_other_files_saying_why_and_keeps_it(tmp_path):
    target = tmp_path / "results"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    (target / "plots").mkdir()
    with pytest.raises(
        IsADirectoryError,
        match=r"'.*results': the path exists and is a directory that is not a checkpoint \(it holds 'notes.txt', 'plots' \.\.\., but no"
        r" '.metadata' or 'meta.pt'\), and saving would replace it, deleting what is in it\. Choose a path inside"
        r" it, an empty folder, or a new path\.",
    ):
        save_state(target, {"model": torch.nn.Linear(2, 2)}, full=True)
    assert (target / "notes.txt").read_text() == "keep me" and sorted(p.name for p in tmp_path.iterdir()) == ["results"]


@pytest.mark.parametrize("before", ["user-files", "user-files-and-a-checkpoint"])
def test_a_distributed_save_goes_in_among_the_users_files_and_keeps_them(tmp_path, before):
    # As Lightning's strategy does: its files are written into the folder, and what else is there stays.
    target = tmp_path / "results"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    (target / "plots").mkdir()
    (target / "plots" / "loss.png").write_bytes(b"png")
    if before == "user-files-and-a-checkpoint":  # a bigger one: its extra shard must go
        save_state(target, {"model": torch.nn.Linear(4, 4), "step": 0}, full=False)
        (target / "__7_0.distcp").write_bytes(b"a shard of a run on more ranks")
    model = torch.nn.Linear(2, 2)
    save_state(target, {"model": model, "step": 1}, full=False)
    state = {"model": torch.nn.Linear(2, 2), "step": 0}
    load_state(target, state)
    assert state["step"] == 1 and torch.equal(state["model"].weight, model.weight)
    assert sorted(p.name for p in target.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt", "notes.txt", "plots"]
    assert (target / "notes.txt").read_text() == "keep me" and (target / "plots" / "loss.png").read_bytes() == b"png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]


def test_commit_among_the_users_files_never_leaves_a_complete_checkpoint_mixed_with_the_previous(tmp_path, calls):
    # The previous .metadata goes first and the new one comes last, each step durable before the next: a crash
    # between leaves an incomplete checkpoint (load says so), never the new shards under the old .metadata.
    target = tmp_path / "results"
    make_entry(target, "folder", "v1")
    (target / "__2_0.distcp").write_bytes(b"v1: a shard the new checkpoint does not write")
    (target / "notes.txt").write_text("keep me")
    token = new_token()
    staged = staging_path(target, token)
    files = make_entry(staged, "folder", "v2")
    calls.clear()

    commit_among(target, staged, shards_synced=False)

    target, staged = target.absolute(), staged.absolute()
    ops = [(op, arg) for op, arg in calls if op != "fsync" or arg in (target, target.parent) or arg.parent == staged]
    first_move = next(i for i, (op, _) in enumerate(ops) if op == "replace")
    staged_synced = [arg for op, arg in ops[:first_move] if op == "fsync" and arg.parent == staged]
    assert sorted(staged_synced) == sorted(staged / f for f in files), ops
    assert ("remove", target / ".metadata") in ops[:first_move], ("the old .metadata goes first", ops)
    removed_old = ops.index(("remove", target / ".metadata"))
    assert ("fsync", target) in ops[removed_old:first_move], ("made durable before the new files come", ops)
    moves = [arg for op, arg in ops if op == "replace"]
    assert moves[-1] == (staged / ".metadata", target / ".metadata"), ("the new .metadata comes last", ops)
    last = ops.index(("replace", moves[-1]))
    assert ("remove", target / "__2_0.distcp") in ops[:last] and ("fsync", target) in ops[last - 1 : last], ops
    assert ("fsync", target) in ops[last + 1 :], ("the new .metadata made durable", ops)
    assert sorted(p.name for p in target.iterdir()) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "meta.pt",
        "notes.txt",
    ]
    assert all((target / f).read_bytes().startswith(b"v2") for f in files) and not staged.exists()


@pytest.mark.parametrize("full", [True, False], ids=["full", "distributed"])
def test_saving_again_to_one_path_writes_over_the_replaced_checkpoint_instead_of_deleting_it(tmp_path, full):
    checkpointer = Checkpointer()
    model = torch.nn.Linear(4, 4)
    target, other = tmp_path / "last", tmp_path / "other"

    def files(entry: Path) -> dict[str, int]:  # name -> inode
        found = [entry] if entry.is_file() else sorted(entry.rglob("*.distcp"))
        return {p.name: p.stat().st_ino for p in found}

    checkpointer.save(target, {"model": model, "step": 1}, full=full)
    first = files(target)
    checkpointer.save(target, {"model": model, "step": 2}, full=full)  # sets the first aside, kept
    assert [p.name for p in tmp_path.glob(".last.old-*")] != []
    checkpointer.save(target, {"model": model, "step": 3}, full=full)  # written over the first one's files
    assert files(target) == first
    checkpointer.save(other, {"model": model, "step": 1}, full=full)  # the spare of "last" is deleted
    checkpointer.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last", "other"]
    state = {"model": torch.nn.Linear(4, 4), "step": 0}
    load_state(target, state)
    assert state["step"] == 3 and torch.equal(state["model"].weight, model.weight)


def test_a_reused_folder_is_an_incomplete_checkpoint_until_the_new_save_writes_its_metadata(tmp_path):
    target = tmp_path / "ckpt"
    make_entry(target, "folder", "v2")
    spare = tmp_path / ".ckpt.old-abc"
    make_entry(spare, "folder", "v1")
    token = new_token()
    assert not reuse_as_staging(spare, tmp_path / "other", token, folder=True)  # another path's
    assert not reuse_as_staging(spare, target, token, folder=False)  # a folder, for a file save
    assert reuse_as_staging(spare, target, token, folder=True)
    staged = staging_path(target, token)
    assert sorted(p.name for p in staged.iterdir()) == ["__0_0.distcp", "__1_0.distcp"] and not spare.exists()
    with pytest.raises(ValueError, match="incomplete"):  # what a crash now would leave: never loadable
        load_state(staged, {"model": torch.nn.Linear(2, 2)})
