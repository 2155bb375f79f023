"""The warm ``python`` the program tests launch with (``warm_python``): a program run through it behaves, as far as
its launcher and its output can tell, as in a fresh interpreter; what it cannot run the same way, it runs fresh."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "file": globals().get("__file__"),
                  "executable": sys.executable, "cwd": os.getcwd(), "env": os.environ.get("PROBE_VALUE"),
                  "hash": hash("modelpar"), "pid": os.getpid()}))
"""


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", **extra}


def _run(python: str, *args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, *args], cwd=cwd, env=_env(**env), capture_output=True, text=True, timeout=60)


def _probe(done: subprocess.CompletedProcess[str]) -> dict[str, object]:
    import json

    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_script_and_a_module_see_their_argv_path_folder_and_environment_as_in_a_fresh_interpreter(
    program_python, tmp_path
):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "probe.py").write_text(PROBE)
    (tmp_path / "probe_module.py").write_text(PROBE)
    seen = {}
    for python in (program_python, sys.executable):
        as_script = _probe(_run(python, "sub/probe.py", "a", "--b", cwd=tmp_path, PROBE_VALUE="x"))
        as_module = _probe(_run(python, "-m", "probe_module", "c", cwd=tmp_path))
        seen[python] = [
            {k: v for k, v in p.items() if k not in ("executable", "pid", "hash")} for p in (as_script, as_module)
        ]
    assert seen[program_python] == seen[sys.executable]
    as_script, as_module = seen[program_python]
    assert as_script["argv"] == ["sub/probe.py", "a", "--b"] and as_script["name"] == "__main__"
    assert as_script["path0"] == str(tmp_path / "sub") and as_script["file"] == str(tmp_path / "sub/probe.py")
    assert as_script["cwd"] == str(tmp_path) and as_script["env"] == "x"
    assert as_module["argv"] == [str(tmp_path / "probe_module.py"), "c"] and as_module["path0"] == str(tmp_path)
    # Launchers start their ranks with sys.executable: the warm one again.
    assert _probe(_run(program_python, "sub/probe.py", cwd=tmp_path))["executable"] == program_python


def test_exit_codes_tracebacks_and_death_by_signal_reach_the_launcher(program_python, tmp_path):
    (tmp_path / "exits.py").write_text("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)")
    (tmp_path / "raises.py").write_text("raise ValueError('the message')")
    (tmp_path / "killed.py").write_text("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    done = _run(program_python, "exits.py", cwd=tmp_path)
    assert (done.returncode, done.stdout, done.stderr.splitlines()[-1]) == (3, "out\n", "err")
    done = _run(program_python, "raises.py", cwd=tmp_path)
    assert done.returncode == 1 and "ValueError: the message" in done.stderr and "Traceback" in done.stderr
    assert _run(program_python, "killed.py", cwd=tmp_path).returncode == -signal.SIGKILL
    done = _run(program_python, "missing.py", cwd=tmp_path)
    assert done.returncode == 2 and "can't open file" in done.stderr


def test_atexit_handlers_and_threads_end_the_program_as_in_a_fresh_interpreter(program_python, tmp_path):
    (tmp_path / "ends.py").write_text(
        textwrap.dedent("""
        import atexit, threading, time
        atexit.register(print, "atexit")
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread", flush=True))).start()
        print("main", flush=True)
        """)
    )
    assert _run(program_python, "ends.py", cwd=tmp_path).stdout.split() == ["main", "thread", "atexit"]


def test_signals_to_the_launched_pid_reach_the_program_and_its_killer_kills_it(program_python, tmp_path):
    (tmp_path / "waits.py").write_text(
        textwrap.dedent("""
        import os, signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), sys.exit(7)))
        open("pid", "w").write(str(os.getpid()))
        print("ready", flush=True)
        time.sleep(60)
        """)
    )
    for how in ("SIGTERM", "SIGKILL"):
        proc = subprocess.Popen(
            [program_python, "waits.py"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        program = int((tmp_path / "pid").read_text())
        assert program != proc.pid  # a fork of the warm interpreter
        proc.send_signal(getattr(signal, how))
        _wait_or_report(proc, program, how)
        if how == "SIGTERM":  # passed on: the program's handler ran and chose the exit code
            assert (proc.returncode, proc.stdout.read()) == (7, "terminated\n")
        else:  # the launched process is gone: so is the program
            assert proc.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while _alive(program) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(program)


def test_a_launcher_killed_before_reading_the_programs_pid_takes_the_program_with_it(program_python, tmp_path):
    # Under load a launcher can die after its program started but before it read the "pid" line the server sent
    # it. Its socket then closes with that line unread, and the server's monitor gets a reset instead of an end of
    # file: it must kill the program all the same (until 2026-11-28 the monitor ended there and the program ran
    # on). This is the client's protocol by hand, so that the line is certainly unread when the socket closes.
    import json
    import socket

    if program_python == sys.executable:
        pytest.skip("no warm interpreter here (a CUDA machine, or one it cannot start on): nothing to kill with it")
    (tmp_path / "waits.py").write_text(
        'import os, time\nopen("pid", "w").write(str(os.getpid()))\nprint("ready", flush=True)\ntime.sleep(60)\n'
    )
    env = _env(**{k: v for k, v in os.environ.items() if k.startswith("MODELPAR_WARM_")})
    request = {"options": [], "target": ["waits.py"], "args": [], "env": env, "cwd": str(tmp_path)}
    payload = json.dumps({**request, "executable": program_python}).encode()
    out_r, out_w = os.pipe()
    with open(os.devnull, "rb") as stdin, open(os.devnull, "wb") as stderr:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(os.environ["MODELPAR_WARM_SOCKET"].split(os.pathsep)[0])
        socket.send_fds(conn, [len(payload).to_bytes(8, "little")], [stdin.fileno(), out_w, stderr.fileno()])
        conn.sendall(payload)
    os.close(out_w)
    with os.fdopen(out_r) as out:
        assert out.readline() == "ready\n"  # the program runs: the server has sent its pid, which stays unread
    program = int((tmp_path / "pid").read_text())
    conn.close()  # as the kernel closes a killed launcher's socket
    deadline = time.monotonic() + 10
    while _alive(program) and time.monotonic() < deadline:
        time.sleep(0.05)
    if _alive(program):
        os.kill(program, signal.SIGKILL)
        pytest.fail(f"the program (pid {program}) outlived its launcher's connection by 10 s")


def _wait_or_report(proc: subprocess.Popen[str], program: int, how: str) -> None:
    """Wait for the launcher; if it has not ended within a minute, fail with where each process stands.

    Seen once in a whole-suite run under ``-n 2`` (2026-11-28): the launcher had not ended 10 s after SIGTERM, and
    300 runs beside the distributed tests, or beside busy loops, did not show it again (at most 2.8 s). The test
    asserts that the signal passes on, not how fast: so a long wait, and a failure that says which process was stuck
    where (the launcher, the program, the server's monitor between them) and what the program printed.
    """
    try:
        proc.wait(timeout=60)
        return
    except subprocess.TimeoutExpired:
        pass
    monitor = int(_stat(program)[1]) if _alive(program) else None
    report = [_where("launcher", proc.pid), _where("program", program)]
    report += [_where("monitor", monitor)] if monitor else []
    proc.kill()
    with contextlib.suppress(ProcessLookupError):
        os.kill(program, signal.SIGKILL)
    printed = proc.stdout.read() if proc.stdout else ""
    pytest.fail(f"{how}: the launcher had not ended after 60 s; program printed {printed!r}; " + "; ".join(report))


def _where(role: str, pid: int) -> str:
    """A process's state, kernel wait channel and signal masks, from ``/proc`` (what a stuck process shows)."""
    try:
        state = _stat(pid)[0]
        wchan = Path(f"/proc/{pid}/wchan").read_text()
        status = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError as e:
        return f"{role} {pid}: gone ({e.strerror})"
    masks = " ".join(line.replace("\t", "") for line in status if line[:6] in ("SigPnd", "ShdPnd", "SigBlk", "SigCgt"))
    return f"{role} {pid}: state {state}, waiting in {wchan or '-'}, {masks}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not _stat(pid)[0].startswith("Z")


def _stat(pid: int) -> list[str]:
    """``/proc/PID/stat``'s fields after the command name: the state, the parent's pid, ..."""
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1].split()


def test_warning_filters_follow_pythonwarnings_and_the_command_line(program_python, tmp_path):
    (tmp_path / "lib_mod.py").write_text("import warnings\ndef f():\n    warnings.warn('old', DeprecationWarning)\n")
    (tmp_path / "warns.py").write_text("import lib_mod\nfor _ in range(3):\n    lib_mod.f()\nprint('done')")
    quiet = _run(
        program_python, "warns.py", cwd=tmp_path
    )  # Python's defaults: a library's DeprecationWarning is hidden
    assert "DeprecationWarning: old" not in quiet.stderr and quiet.stdout == "done\n"
    once = _run(program_python, "warns.py", cwd=tmp_path, PYTHONWARNINGS="default")
    assert once.stderr.count("DeprecationWarning: old") == 1, once.stderr
    error = _run(program_python, "-W", "error::DeprecationWarning", "warns.py", cwd=tmp_path)
    assert error.returncode == 1 and "DeprecationWarning: old" in error.stderr


def test_ranks_of_different_parity_hash_strings_differently_and_startup_variables_run_fresh(program_python, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    seen = {rank: _probe(_run(program_python, "probe.py", cwd=tmp_path, LOCAL_RANK=rank)) for rank in "0123"}
    assert seen["0"]["hash"] == seen["2"]["hash"] != seen["1"]["hash"] == seen["3"]["hash"]
    assert len({p["pid"] for p in seen.values()}) == 4
    # torch's thread pool is sized at import: another OMP_NUM_THREADS needs a fresh interpreter.
    done = _run(program_python, "probe.py", cwd=tmp_path, OMP_NUM_THREADS="2", MODELPAR_WARM_VERBOSE="1")
    assert "fresh interpreter (OMP_NUM_THREADS)" in done.stderr and _probe(done)["executable"] == sys.executable
    done = _run(program_python, "-c", "import sys; print(sys.executable)", cwd=tmp_path, MODELPAR_WARM_VERBOSE="1")
    assert "fresh interpreter (command line)" in done.stderr and done.stdout.strip() == sys.executable


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_is_unbuffered_where_asked(program_python, tmp_path, stream):
    (tmp_path / "talks.py").write_text(f"import sys, time\nsys.{stream}.write('first\\n')\ntime.sleep(30)")
    where = {stream: subprocess.PIPE}
    command = [program_python, "-u", "talks.py"]
    proc = subprocess.Popen(command, cwd=tmp_path, env=_env(), text=True, **where)  # type: ignore[call-overload]
    try:
        lines = iter(getattr(proc, stream).readline, "")  # stderr begins with what the preloaded imports printed
        assert "first\n" in lines  # before the program ends: written through
    finally:
        proc.kill()
        proc.wait()


FROZEN_EXIT = """
import atexit, gc, sys, types
sys.path.insert(0, sys.argv[1])
from warm_python.frozen import freeze, nanobind_loaded
atexit.register(lambda: print("frozen at exit", gc.get_freeze_count() > 0))  # before freeze's: runs after it
if sys.argv[2] == "with nanobind":  # what an extension built with nanobind holds: objects of its types
    extension = types.ModuleType("an_extension")
    extension.function = type("nb_func", (), {"__module__": "nanobind"})()
    sys.modules["an_extension"] = extension
print("nanobind loaded", nanobind_loaded())
freeze()
"""


@pytest.mark.parametrize(
    ("case", "printed"), [("with nanobind", "True\nfrozen at exit False"), ("alone", "False\nfrozen at exit True")]
)
def test_a_frozen_heap_is_unfrozen_at_exit_only_where_nanobind_would_print_it_as_leaks(tmp_path, case, printed):
    # A frozen heap is never collected, the last collection at exit included; nanobind (triton 3.9's bindings) then
    # prints the objects it made as ~30 lines of leaks, at the end of every program the warm python runs and of
    # every test process that froze its heap. Unfreezing costs 1.3 s an exit: only where nanobind is there to print.
    (tmp_path / "exits.py").write_text(FROZEN_EXIT)
    tests = str(Path(__file__).resolve().parents[1])
    done = subprocess.run([sys.executable, "exits.py", tests, case], cwd=tmp_path, capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, f"nanobind loaded {printed}\n", "")
