"""A rank that dies never hangs the others: real launchers, one rank killed or frozen in the middle of step 3.

Four launches of two CPU processes (gloo). What each launcher does on its own and what the watchdog adds is
written up in docs/checkpointing.md ("When a process dies"). A frozen process (SIGSTOP) keeps its sockets open,
as a hung process or an unreachable host does: nothing but the watchdog notices it.

The launchers run through the warm ``python`` (``warm_python``): the pids the script writes are the programs', and
the launched processes end as their programs end (by the same signal), so a launcher sees what it would see.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from harness import free_port
from modelpar._mesh.watchdog import PEER_LOST_EXIT_CODE

SCRIPT = Path(__file__).with_name("rank_death_script.py")
PEER_TIMEOUT = 3.0  # seconds; heartbeats every 0.5 s
#: Seconds from the victim's signal until every other process has ended: PEER_TIMEOUT plus a heartbeat, with
#: room for a machine loaded by other jobs. Without the watchdog a frozen rank holds the others for 30 minutes.
BOUND = 20.0
LAUNCH_LIMIT = 120.0  # seconds for start-up and two steps on a loaded machine


def _launch(python: str, tmp_path: Path, launcher: str, victim: int, signal_name: str) -> subprocess.Popen[str]:
    args = [str(SCRIPT), launcher, str(victim), signal_name, str(tmp_path), str(PEER_TIMEOUT)]
    port = free_port()
    if launcher == "torchrun":
        args = ["-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
        args += [f"--master-port={port}", str(SCRIPT), launcher, str(victim), signal_name, str(tmp_path)]
        args += [str(PEER_TIMEOUT)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([python, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _signalled_at(tmp_path: Path, proc: subprocess.Popen[str]) -> float:
    """When the victim signalled itself (the launching process may be the victim: read before polling it)."""
    deadline = time.monotonic() + LAUNCH_LIMIT
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, ValueError):  # not yet written, or half
            return float((tmp_path / "signalled").read_text())
        if proc.poll() is not None and not (tmp_path / "signalled").exists():
            break
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"rank never reached step 3:\n{proc.communicate()[0][-4000:]}")


def _pid(tmp_path: Path, rank: int) -> int:
    return int((tmp_path / f"pid{rank}").read_text())


def _ended(pid: int) -> bool:
    """Exited (gone, or a zombie its parent has not reaped yet: the parent may be the frozen rank)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_ended(pids: list[int], signalled: float) -> float:
    """Seconds from the victim's signal until every PID has ended; fails after BOUND."""
    while time.time() - signalled < BOUND + 5:
        if all(_ended(p) for p in pids):
            return time.time() - signalled
        time.sleep(0.1)
    raise AssertionError(f"processes {[p for p in pids if not _ended(p)]} still run {BOUND + 5:.0f} s after the signal")


def _finish(proc: subprocess.Popen[str], tmp_path: Path, *frozen: int) -> str:
    """Kill what the test froze (as torchrun would after 30 s) and collect the output; leave no rank behind."""
    for pid in frozen:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    try:
        return proc.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[0]
    finally:
        for rank in (0, 1):
            if (tmp_path / f"pid{rank}").exists() and not _ended(pid := _pid(tmp_path, rank)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def test_a_rank_killed_mid_training_under_torchrun_ends_the_job_within_seconds(tmp_path, program_python):
    # torchrun's agent polls its workers every 0.1 s and stops the others when one fails: modelpar adds nothing here
    proc = _launch(program_python, tmp_path, "torchrun", victim=1, signal_name="SIGKILL")
    signalled = _signalled_at(tmp_path, proc)
    output = _finish(proc, tmp_path)
    elapsed = time.time() - signalled
    assert proc.returncode != 0 and elapsed < BOUND, (elapsed, output[-3000:])
    root_cause = output[output.index("Root Cause") :]
    # torch 2.11's summary puts "Signal 9 (SIGKILL)" on the traceback line, later releases beside the exit code
    killed = r"rank\s+: 1 \(local_rank: 1\)\s+exitcode\s+: -9 [^\n]*(\n[^\n]*){0,2}?\(?SIGKILL\)?"
    assert re.search(killed, root_cause), output[-3000:]


def test_a_frozen_rank_under_torchrun_ends_the_others_within_peer_timeout_naming_it(tmp_path, program_python):
    proc = _launch(program_python, tmp_path, "torchrun", victim=1, signal_name="SIGSTOP")
    signalled = _signalled_at(tmp_path, proc)
    frozen = _pid(tmp_path, 1)
    try:
        elapsed = _wait_ended([_pid(tmp_path, 0)], signalled)
    finally:
        output = _finish(proc, tmp_path, frozen)
    assert PEER_TIMEOUT - 1 <= elapsed < BOUND, elapsed  # judged from the last answer, up to a heartbeat earlier
    expected = (
        f"modelpar: ending rank 0 (exit code {PEER_LOST_EXIT_CODE}) because rank 1 (pid {frozen} on host "
        f"{os.uname().nodename}) has not sent a heartbeat for 3 s: it died, hangs, or its host is unreachable"
    )
    assert expected in output, output[-3000:]
    root_cause = output[output.index("Root Cause") :]  # torchrun's summary shows the watchdog's message
    assert f"exitcode  : {PEER_LOST_EXIT_CODE}" in root_cause and "modelpar: ending rank 0" in root_cause


def test_rank_0_killed_under_the_fabric_launcher_is_named_in_the_survivors_error(tmp_path, program_python):
    # rank 0 is the launching process and hosts the store; gloo fails rank 1 at once, the watchdog says why
    proc = _launch(program_python, tmp_path, "fabric", victim=0, signal_name="SIGKILL")
    signalled = _signalled_at(tmp_path, proc)
    child = _pid(tmp_path, 1)
    elapsed = _wait_ended([child], signalled)
    output = _finish(proc, tmp_path)
    assert elapsed < BOUND and proc.returncode == -signal.SIGKILL, (elapsed, output[-3000:])
    expected = (
        f"modelpar: rank 1 failed with the error above, most likely because rank 0 (pid {_pid(tmp_path, 0)} on host"
        f" {os.uname().nodename}) has exited"
    )
    assert expected in output, output[-3000:]


def test_rank_0_frozen_under_the_fabric_launcher_ends_its_orphaned_child_which_ends_it(tmp_path, program_python):
    # the frozen launcher hosts the store and Lightning's observer of its children: neither can act
    proc = _launch(program_python, tmp_path, "fabric", victim=0, signal_name="SIGSTOP")
    signalled = _signalled_at(tmp_path, proc)
    try:
        elapsed = _wait_ended([_pid(tmp_path, 1), _pid(tmp_path, 0)], signalled)
    finally:
        output = _finish(proc, tmp_path, _pid(tmp_path, 0))
    assert PEER_TIMEOUT - 1 <= elapsed < BOUND, elapsed  # judged from the last answer, up to a heartbeat earlier
    assert f"modelpar: ending rank 1 (exit code {PEER_LOST_EXIT_CODE}) because the job's c10d store at" in output
    assert "has not answered for 3 s: the process hosting it died (rank 0 under Lightning's launchers" in output
    # rank 0's pid is the launched process's; through the warm python, the fork that runs the program
    assert f"modelpar: rank 1 killed rank 0 (SIGKILL to pid {_pid(tmp_path, 0)})." in output and proc.returncode == -9
