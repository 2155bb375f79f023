"""A warm ``python`` for the programs the tests launch (examples, documented programs, ``torchrun`` scripts).

A fresh interpreter spends 7 to 9 s of CPU importing torch, Lightning and transformers before a program's first
line runs, and a launch of 4 ranks starts 4 of them (5 under ``torchrun``); on the 2 cores of CI that was about a
third of the suite's CPU. :func:`start` runs interpreters that import those libraries once (:mod:`.server`), and
writes an executable named ``python`` (:mod:`.client`) that runs each program in a fork of one, with the program's
command line, environment, folder and standard streams, its exit code and signals passed through. Launchers started
through it (``python -m torch.distributed.run``, Fabric's ``launch()``) start their ranks with ``sys.executable``,
which is that same ``python``, so the ranks start warm too.

The program runs its own code and modelpar's as it would in a fresh interpreter (modelpar reads its environment
when it runs, never at import); what the warm interpreter read at its start, it checks: a program whose
environment differs in such a variable, or a command line of another form, runs in a real fresh interpreter.
Two servers, each with its own hash seed, take the ranks by the parity of ``LOCAL_RANK``, so that ranks 0 and 1
still iterate a set of strings in different orders, as fresh interpreters do (a rank-dependent order that breaks a
collective shows here as it would for a user). Programs whose claim is about the interpreter itself (a ``-c`` probe
of what gets imported, the memory of a fresh process) keep ``sys.executable``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["WarmPython", "start"]

_HERE = Path(__file__).resolve().parent
#: Servers, each with its own hash seed: ``LOCAL_RANK % SERVERS`` picks one.
SERVERS = 2
#: What a shebang line may hold on Linux (127 bytes before 5.1); a longer path means no warm interpreter.
_SHEBANG_LIMIT = 127
#: What a Unix socket's path may hold (108 bytes with its terminating zero).
_SOCKET_LIMIT = 100


@dataclass
class WarmPython:
    """Running warm interpreters: ``executable`` is the ``python`` to launch programs with; ``env``, what the
    programs' environment must hold for it to find them (:func:`start` exports it to this process)."""

    executable: str
    env: dict[str, str]
    processes: list[subprocess.Popen[bytes]]
    short_folder: str | None  # where the sockets are when pytest's folder makes too long a path for them

    def close(self) -> None:
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for sock in self.env["MODELPAR_WARM_SOCKET"].split(os.pathsep):
            if os.path.exists(sock):
                os.unlink(sock)
        if self.short_folder is not None:
            os.rmdir(self.short_folder)


def start(folder: Path, base_env: dict[str, str]) -> tuple[WarmPython | None, str]:
    """(running warm interpreters, "") or (None, why not) for programs launched with ``base_env``."""
    shebang = f"#!{sys.executable} -IS\n"
    if len(shebang) > _SHEBANG_LIMIT or any(c.isspace() for c in sys.executable):
        return None, f"a shebang line cannot name this interpreter (too long, or a space in it): {sys.executable}"
    executable = folder / "python"
    executable.write_text(shebang + (_HERE / "client.py").read_text())
    executable.chmod(0o755)
    sockets = [str(folder / f"socket{i}") for i in range(SERVERS)]
    short = None
    if max(map(len, sockets)) > _SOCKET_LIMIT:
        short = tempfile.mkdtemp(prefix="warm-python-", dir="/tmp")
        sockets = [os.path.join(short, f"socket{i}") for i in range(SERVERS)]
    # The warning filters the tests' programs run with: the server prints what its imports warn under them.
    env = {**base_env, "PYTHONWARNINGS": "default"}
    processes = []
    for i, sock in enumerate(sockets):
        log = folder / f"server{i}.log"  # what the imports print, which each program prints first
        with log.open("wb") as stderr:
            command = [sys.executable, str(_HERE / "server.py"), sock, str(os.getpid()), str(log)]
            processes.append(
                subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=stderr, start_new_session=True)
            )
    for i, process in enumerate(processes):  # they import at the same time
        assert process.stdout is not None
        if process.stdout.readline().strip() != b"ready":
            for other in processes:
                other.kill()
                other.wait()
            if short is not None:
                shutil.rmtree(short, ignore_errors=True)
            printed = (folder / f"server{i}.log").read_text()[-2000:]
            return None, f"the warm interpreter did not start (exit code {process.returncode}): {printed}"
        process.stdout.close()
    env = {"MODELPAR_WARM_REAL": sys.executable, "MODELPAR_WARM_SOCKET": os.pathsep.join(sockets)}
    return WarmPython(str(executable), env, processes, short), ""
