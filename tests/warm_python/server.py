"""The warm interpreter: a process that has imported torch, Lightning and transformers once, and forks a copy of
itself for each program the tests launch through :mod:`client`.

Run as ``python server.py SOCKET PARENT_PID LOG`` with its standard error written to ``LOG``; it serves until its
parent is gone. Each request is a
program's command line, environment, working folder and standard streams. For each, the server forks a
monitor, and the monitor forks the program: the program gets the streams, the environment, the folder and
``sys.argv``, then runs the script (or ``-m`` module) as ``__main__``, as a fresh interpreter would, and the
interpreter ends the way a fresh one ends (``atexit`` handlers, non-daemon threads joined, streams flushed).
The monitor tells the client the program's pid and, when it ends, its wait status; if the client goes away
first (killed), the monitor kills the program.

What a fresh interpreter would read at start-up and this one read already (``PYTHONPATH``, the hash seed, the
thread count of torch's OpenMP pool, torch's logging and compile settings, Hugging Face's offline switches ...)
must be what the request says: a request whose environment differs from the server's in such a variable is
answered "fresh", and the client starts a real interpreter instead.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
import warnings
from typing import Any

from frozen import freeze  # this folder's: first on the path until main() takes the folder off

#: The preloaded modules, in their import order; a module that is not installed is skipped.
PRELOAD = [
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "torch.distributed.run",
    "lightning_fabric",
    "pytorch_lightning",
    "lightning.pytorch",
    "transformers.quantizers.auto",
    "torchao.float8",
    "s3fs",
    "modelpar",
    "modelpar.fabric",
    "modelpar.hf",
    "modelpar.trainer",
]

#: Prefixes of environment variables read while the interpreter starts or while the preloaded modules import.
STARTUP_PREFIXES = (
    "PYTHON",
    "OMP_",
    "MKL_",
    "KMP_",
    "GOMP_",
    "LD_",
    "TORCH_LOGS",
    "TORCHDYNAMO",
    "TORCHINDUCTOR",
    "TORCH_COMPILE",
    "TORCH_SHOW",
    "TORCHAO",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "LC_",
    "LANG",
)
#: Start-up variables the program's own set-up applies, so they may differ.
APPLIED = ("PYTHONUNBUFFERED", "PYTHONWARNINGS", "PYTHONDONTWRITEBYTECODE")


def startup_difference(env: dict[str, str], own: dict[str, str]) -> list[str]:
    """The start-up variables whose value in ``env`` is not this interpreter's."""
    keys = set(env) | set(own)
    return sorted(k for k in keys if k.startswith(STARTUP_PREFIXES) and k not in APPLIED and env.get(k) != own.get(k))


def _streams(unbuffered: bool) -> None:
    """New ``sys.stdin/stdout/stderr`` over descriptors 0, 1, 2, made as a fresh interpreter makes them."""
    encoding = sys.stdout.encoding
    made = []
    for fd, mode in ((0, "r"), (1, "w"), (2, "w")):
        raw = io.FileIO(fd, mode + "b", closefd=False)
        tty = raw.isatty()
        if mode == "w" and unbuffered:
            binary: Any = raw
        else:
            binary = (io.BufferedReader if mode == "r" else io.BufferedWriter)(raw)
        text = io.TextIOWrapper(
            binary,
            encoding=encoding,
            errors="backslashreplace" if fd == 2 else "strict",
            line_buffering=(mode == "w" and (tty or fd == 2)),
            write_through=(mode == "w" and unbuffered),
        )
        made.append(text)
    sys.stdin, sys.stdout, sys.stderr = made
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = made


def _run_program(
    request: dict[str, Any], base_path: list[str], library_filters: list[Any], imports_printed: bytes
) -> int:
    """Become the program; return its exit code (an uncaught exception: its traceback, 1)."""
    import runpy
    import tempfile
    import types

    # What the imports printed (warnings, torchao's kernels it could not load ...), as a fresh interpreter prints
    # it when the program imports them: first. All of it, also what the program would not have imported.
    os.write(2, imports_printed)

    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    tempfile.tempdir = None
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    sys.executable = request["executable"]
    options, target, args = request["options"], request["target"], request["args"]
    unbuffered = "-u" in options or bool(env.get("PYTHONUNBUFFERED"))
    _streams(unbuffered)
    # The warning filters as a fresh interpreter has them after importing the same libraries: the libraries'
    # own, then the command line's and PYTHONWARNINGS' (``-W`` last, so it wins), then Python's defaults.
    warnoptions = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
    warnoptions += [o[2:] for o in options if o.startswith("-W")]
    sys.warnoptions[:] = warnoptions
    warnings.filters[:] = list(_DEFAULT_FILTERS)
    warnings._processoptions(warnoptions)  # type: ignore[attr-defined]  # Python's own parser of -W options
    warnings.filters[:0] = library_filters
    warnings._filters_mutated()  # type: ignore[attr-defined]  # forget what was shown once before the fork
    # Python reseeds ``random`` in a fork by itself; numpy's global generator, seeded at its import, it does not.
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    try:
        if target[0] == "-m":
            sys.path[:] = [os.getcwd(), *base_path]
            sys.argv[:] = [target[1], *args]  # runpy replaces the first item with the module's file
            runpy._run_module_as_main(target[1], alter_argv=True)  # type: ignore[attr-defined]
        else:
            script = target[0]
            if not os.path.isfile(script):
                path = os.path.abspath(script)
                print(f"{request['executable']}: can't open file {path!r}: [Errno 2] No such file", file=sys.stderr)
                return 2
            sys.path[:] = [os.path.dirname(os.path.realpath(script)), *base_path]
            sys.argv[:] = [script, *args]
            main.__file__ = os.path.abspath(script)  # absolute for __main__ since Python 3.9
            main.__builtins__ = builtins  # type: ignore[attr-defined]
            main.__cached__ = None  # type: ignore[attr-defined]
            with open(script, "rb") as f:
                code = compile(f.read(), script, "exec")
            exec(code, main.__dict__)
    except SystemExit as done:
        return _exit_code(done.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        sys.excepthook(*sys.exc_info())
        return 1
    return 0


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _monitor(conn: socket.socket, program: int) -> None:
    """Report the program's pid, then its wait status; kill it if the client goes away first."""
    conn.sendall(f"pid {program}\n".encode())
    try:
        watched, poll = [conn, os.pidfd_open(program)], None
    except (AttributeError, OSError):  # Linux before 5.3: look every 50 ms
        watched, poll = [conn], 0.05
    while True:
        ready, _, _ = select.select(watched, [], [], poll)
        ended, status = os.waitpid(program, os.WNOHANG)
        if ended:
            with contextlib.suppress(OSError):
                conn.sendall(f"status {status}\n".encode())
            return
        if conn in ready and _gone(conn):
            os.kill(program, signal.SIGKILL)
            os.waitpid(program, 0)
            return


def _gone(conn: socket.socket) -> bool:
    """Whether the client closed its end. A client killed before it read the pid line closes it with that line
    unread, and the kernel then reports a reset (ECONNRESET) rather than an end of file: gone all the same."""
    try:
        return not conn.recv(1024)
    except OSError:
        return True


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request: its length (8 bytes, sent with the three descriptors), then its JSON."""
    head, fds, _, _ = socket.recv_fds(conn, 8, 3)
    while len(head) < 8 and (more := conn.recv(8 - len(head))):
        head += more
    size = int.from_bytes(head, "little")
    body = b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            break
        body += chunk
    return json.loads(body.decode()), fds


def _serve(
    listener: socket.socket,
    parent: int,
    own_env: dict[str, str],
    base_path: list[str],
    library_filters: list[Any],
    imports_printed: bytes,
) -> int:
    # What the imports did to the environment (``lightning_fabric`` sets TORCHINDUCTOR_CACHE_DIR), done again in
    # each program as its own imports would.
    imported_env = {k: v for k, v in os.environ.items() if own_env.get(k) != v}
    listener.settimeout(1.0)
    while True:
        if os.getppid() != parent:
            return 0
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            continue
        conn.settimeout(None)
        try:
            request, fds = _receive(conn)
        except (OSError, ValueError):  # a client that went away while it asked: nothing to run
            conn.close()
            continue
        why = startup_difference(request["env"], own_env)
        if why:
            conn.sendall(f"fresh {' '.join(why)}\n".encode())
            conn.close()
            for fd in fds:
                os.close(fd)
            continue
        if os.fork() == 0:  # the monitor
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            program = os.fork()
            if program == 0:
                conn.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                request["env"] = {**request["env"], **imported_env}
                return _run_program(request, base_path, library_filters, imports_printed)
            for fd in fds:
                os.close(fd)
            try:
                _monitor(conn, program)
            finally:
                os._exit(0)
        conn.close()
        for fd in fds:
            os.close(fd)


def main() -> int:
    path, parent, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    missing = [name for name in ("_processoptions", "_filters_mutated") if not hasattr(warnings, name)]
    if missing:  # the warning machinery a program's filters are rebuilt with (private: checked on Python 3.11)
        print(f"warm_python: this Python's warnings module has no {missing}", file=sys.stderr)
        return 1
    here = os.path.dirname(os.path.realpath(__file__))
    base_path = [p for p in sys.path if os.path.realpath(p or ".") != here]
    sys.path[:] = base_path
    sys.modules.pop("frozen")  # a program's own ``import frozen`` must not find this one
    own_env = dict(os.environ)
    before = list(warnings.filters)
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    added = len(warnings.filters) - len(before)
    # What the libraries put in front of the start-up filters (``filterwarnings`` inserts there by default).
    library_filters = list(warnings.filters[:added]) if warnings.filters[added:] == before else []
    # Out of every collection from now on, in the server and in the programs: a program's first full collection
    # would otherwise walk (and copy, page by page) the ~400,000 objects of the imports, and its exit twice that
    # (2.2 s of a 2.5 s program here, against 0.6 s). Unfrozen again at a program's exit where nanobind would
    # otherwise print what was frozen as leaks (see ``frozen``).
    freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped as they end
    if threading.active_count() != 1:
        print(
            f"warm_python: {threading.active_count()} threads after the imports; forks would lose them", file=sys.stderr
        )
        return 1
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    sys.stderr.flush()
    with open(log, "rb") as printed:
        imports_printed = printed.read()
    return _serve(listener, parent, own_env, base_path, library_filters, imports_printed)


#: Python's default filters: those this interpreter started with, less the ones its ``-W`` options put in front.
_DEFAULT_FILTERS = list(warnings.filters[len(sys.warnoptions) :])

if __name__ == "__main__":
    sys.exit(main())
