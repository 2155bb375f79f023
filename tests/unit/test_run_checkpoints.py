"""``RunCheckpoints`` without a process group: names, the retention rule, argument errors, and signals."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from modelpar.checkpoint import Checkpointer, RunCheckpoints
from modelpar.checkpoint._run import Entry, checkpoint_name, flag_device, parse_step, to_delete


def test_names_are_zero_padded_so_listing_order_is_step_order_and_parse_back():
    names = [checkpoint_name(s) for s in (5, 10, 100, 2)]
    assert names[0] == "step-000000005"
    assert sorted(names) == [checkpoint_name(s) for s in (2, 5, 10, 100)]
    assert parse_step("step-000000010") == (10, False)
    assert parse_step("step-7") == (7, False)  # any padding
    assert parse_step(".step-000000010.partial-0123456789ab") == (10, True)
    assert parse_step(".step-000000010.old-0123456789ab") == (10, True)
    for other in ("last.ckpt", "step-", "step-1x", "losses.json", ".step-1.tmp"):
        assert parse_step(other) is None


def _entries(**states: str) -> list[Entry]:
    return [Entry(int(name[1:]), Path(name), state) for name, state in states.items()]


def test_retention_keeps_the_last_k_counting_the_one_just_saved_and_drops_stale_incomplete_ones():
    entries = _entries(s2="complete", s4="complete", s5="incomplete", s6="complete", s7="leftover", s8="complete")
    assert sorted(e.step for e in to_delete(entries, 8, 2)) == [2, 4, 5, 7]
    assert sorted(e.step for e in to_delete(entries, 8, 1)) == [2, 4, 5, 6, 7]
    assert sorted(e.step for e in to_delete(entries, 8, None)) == [5, 7]  # keep all: only the stale ones


def test_retention_never_touches_the_save_in_progress_or_anything_newer():
    # an asynchronous save of step 8 still writing (a leftover now), and an incomplete step 9 from an older run
    entries = _entries(s4="complete", s6="complete", s8="leftover", s9="incomplete")
    assert sorted(e.step for e in to_delete(entries, 8, 2)) == [4]  # step 8 counts as one of the 2


def test_the_signal_flag_is_reduced_on_the_cpu_whenever_the_default_group_has_gloo():
    assert flag_device("gloo") == "cpu"
    assert flag_device("cpu:gloo,cuda:nccl") == "cpu"
    assert flag_device("nccl") == "cuda"


def test_bad_arguments_and_savers_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match=r"every_n_steps=0.*at least 1"):
        RunCheckpoints(tmp_path, every_n_steps=0)
    with pytest.raises(ValueError, match=r"keep_last=0.*at least 1.*None"):
        RunCheckpoints(tmp_path, every_n_steps=1, keep_last=0)
    run = RunCheckpoints(tmp_path, every_n_steps=1)
    with pytest.raises(TypeError, match=r"Cannot save or load checkpoints with a str.*Fabric"):
        run.maybe_save("fabric", 1, {})


def test_a_signal_saves_the_current_step_then_exits_and_the_run_resumes_from_it(tmp_path):
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        model = torch.nn.Linear(3, 3)
        optimizer = torch.optim.AdamW(model.parameters())
        run = RunCheckpoints(tmp_path / "run", every_n_steps=100, keep_last=1, save_on_signal=True)
        assert run.maybe_save(Checkpointer(), 2, {"model": model, "optimizer": optimizer, "step": 2}) is False
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(SystemExit, match=r"Received SIGUSR1: saved the checkpoint of step 3 to .*step-000000003"):
            run.maybe_save(Checkpointer(), 3, {"model": model, "optimizer": optimizer, "step": 3})
        assert seen == [signal.SIGUSR1]  # the handler installed before is chained
        assert signal.getsignal(signal.SIGUSR1) is not run._on_signal  # given back on exit
        fresh = torch.nn.Linear(3, 3)
        state = {"model": fresh, "optimizer": torch.optim.AdamW(fresh.parameters()), "step": 0}
        assert RunCheckpoints(tmp_path / "run", every_n_steps=100).resume(Checkpointer(), state) == 3
        assert state["step"] == 3 and torch.equal(fresh.weight, model.weight)
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_signal_handlers_can_only_be_installed_from_the_main_thread(tmp_path):
    import threading

    errors: list[BaseException] = []

    def create() -> None:
        try:
            RunCheckpoints(tmp_path, every_n_steps=1, save_on_signal=True)
        except RuntimeError as err:
            errors.append(err)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert len(errors) == 1 and "main thread" in str(errors[0]) and "save_on_signal=False" in str(errors[0])


def test_each_torchrun_attempt_rendezvous_under_its_own_keys_in_the_agents_store():
    from modelpar._mesh.process_group import restart_store_prefix

    agent = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert restart_store_prefix({**agent, "TORCHELASTIC_RESTART_COUNT": "0"}) == "modelpar/attempt_0"
    assert restart_store_prefix({**agent, "TORCHELASTIC_RESTART_COUNT": "1"}) == "modelpar/attempt_1"
    assert restart_store_prefix({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}) is None
    assert restart_store_prefix({}) is None  # not under torchrun: rank 0 hosts a fresh store
