"""Saving again to one path writes the shards over the previous checkpoint's files in place, exact-sized.

DCP's own writer opens each shard with ``"wb"``, truncating it (every block freed, then allocated again,
which the ``fsync`` then waits for): `modelpar.checkpoint._overwrite` opens an existing file for update
instead, and cuts off an old tail that the new content does not reach. Real files under ``tmp_path``, no
process group.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystem

from modelpar.checkpoint import Checkpointer, load_state
from modelpar.checkpoint._overwrite import InPlaceFileSystem, local_writer, open_over


@pytest.mark.parametrize("new", [b"short", b"y" * 5000], ids=["shorter", "longer"])
def test_an_existing_file_is_written_over_in_place_and_ends_at_the_last_byte_written(tmp_path, new):
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"x" * 1000)
    inode = path.stat().st_ino
    with InPlaceFileSystem().create_stream(path, "wb") as stream:
        assert path.stat().st_size == 1000  # not truncated on open: the blocks are written over, not freed
        stream.write(new)
        stream.close()  # DCP closes the stream itself, inside the block
    assert path.read_bytes() == new and path.stat().st_ino == inode


def test_dcps_own_file_system_truncates_on_open_which_is_what_writing_over_avoids(tmp_path):
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(b"x" * 1000)
    with FileSystem().create_stream(path, "wb"):
        assert path.stat().st_size == 0


def test_a_writer_that_seeks_back_keeps_everything_up_to_the_furthest_byte(tmp_path):
    path = tmp_path / "file"
    path.write_bytes(b"x" * 100)
    with open_over(path) as stream:
        stream.write(b"header--body")
        stream.seek(0)
        stream.write(b"HEADER")
    assert path.read_bytes() == b"HEADER--body"


def test_the_cut_off_tail_is_fsynced_before_the_stream_is_closed(tmp_path, monkeypatch):
    path = tmp_path / "file"
    path.write_bytes(b"x" * 100)
    sizes: list[int] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        real_fsync(fd)
        sizes.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fsync", spy)
    with open_over(path) as stream:
        stream.write(b"abc")
        os.fsync(stream.fileno())  # what DCP does before closing: the old tail is still there
    assert sizes == [100, 3]


@pytest.mark.parametrize("kind", ["new", "link", "read"])
def test_new_files_links_and_reads_are_opened_as_dcp_opens_them(tmp_path, kind):
    target = tmp_path / "target"
    target.write_bytes(b"old content")
    path = {"new": tmp_path / "fresh", "link": tmp_path / "link", "read": target}[kind]
    if kind == "link":
        path.symlink_to(target)
    with InPlaceFileSystem().create_stream(path, "rb" if kind == "read" else "wb") as stream:
        if kind == "read":
            assert stream.read() == b"old content"
        else:
            assert path.stat().st_size == 0  # "wb": created, or truncated through the link as DCP would
            stream.write(b"new")
    assert path.read_bytes() == (b"old content" if kind == "read" else b"new")


def test_the_writer_uses_the_in_place_file_system_and_keeps_dcps_options(tmp_path):
    writer = local_writer(tmp_path / "ckpt", sync_files=False, overwrite=True)
    assert isinstance(writer.fs, InPlaceFileSystem) and writer.sync_files is False


@pytest.mark.parametrize("full", [True, False], ids=["full", "distributed"])
def test_a_smaller_state_saved_over_a_larger_one_is_exactly_what_a_fresh_save_writes(tmp_path, full):
    checkpointer = Checkpointer()
    target, fresh = tmp_path / "last", tmp_path / "fresh"
    big, small = torch.nn.Linear(64, 64), torch.nn.Linear(4, 4)

    def files(entry: Path) -> dict[str, bytes]:
        found = [entry] if entry.is_file() else sorted(entry.glob("*.distcp"))
        return {"" if full else p.name: p.read_bytes() for p in found}

    checkpointer.save(target, {"model": big, "step": 1}, full=full)
    inodes = {p.name: p.stat().st_ino for p in ([target] if full else target.glob("*.distcp"))}
    checkpointer.save(target, {"model": big, "step": 2}, full=full)
    checkpointer.save(target, {"model": small, "step": 3}, full=full)  # over the first save's files
    checkpointer.save(fresh, {"model": small, "step": 3}, full=full)
    checkpointer.close()

    assert {p.name: p.stat().st_ino for p in ([target] if full else target.glob("*.distcp"))} == inodes
    written, expected = files(target), files(fresh)
    assert {name: len(data) for name, data in written.items()} == {name: len(data) for name, data in expected.items()}
    if not full:  # a full file's pickled metadata is not byte-stable between two saves; its state is, below
        assert written == expected
    state = {"model": torch.nn.Linear(4, 4), "step": 0}
    load_state(target, state)
    assert state["step"] == 3 and torch.equal(state["model"].weight, small.weight)
