"""A ``python`` command for the programs the tests launch: it runs the program in a fork of the warm interpreter
(:mod:`server`) when it can, and otherwise becomes the real interpreter (``exec``) with the same arguments.

Installed by :func:`warm_python.start` as an executable named ``python`` whose first line names the real
interpreter with ``-I -S`` (nothing imported but the standard library's few modules used here: it starts in
milliseconds). It takes the forms launchers use: ``python [-u] [-W ARG] script.py ARGS`` and
``python [-u] [-W ARG] -m module ARGS``; anything else (``-c``, other options, a descriptor to pass on beyond the
three standard streams) runs the real interpreter. The program's pid is the fork's, not this process's: signals
sent here (SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2) are passed on, also those that come before this process
knows the pid, and this process ends as the program ended (its exit code, or killed by the same signal). If this
process is killed, the server kills the program.
``LOCAL_RANK``'s parity picks the server (each has its own hash seed).
"""

import contextlib
import json
import os
import signal
import socket
import sys

REAL = os.environ.get("MODELPAR_WARM_REAL", "")
SOCKET = os.environ.get("MODELPAR_WARM_SOCKET", "")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def fresh(why: str = "") -> None:
    if why and os.environ.get("MODELPAR_WARM_VERBOSE"):
        print(f"warm_python: fresh interpreter ({why})", file=sys.stderr, flush=True)
    # The signal mask survives exec, and Python would never unblock it: a signal held since the request (see
    # main) takes its default action here, as it would have before the interpreter was ready.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    os.execv(REAL, [REAL, *sys.argv[1:]])


def parse(argv: list[str]) -> tuple[list[str], list[str], list[str]] | None:
    """(options, target, arguments), or None for a command line this does not take."""
    options: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-u":
            options.append(arg)
        elif arg == "-W" and i + 1 < len(argv):
            options.append("-W" + argv[i + 1])
            i += 1
        elif arg.startswith("-W") and len(arg) > 2:
            options.append(arg)
        elif arg == "-m" and i + 1 < len(argv):
            return options, ["-m", argv[i + 1]], argv[i + 2 :]
        elif not arg.startswith("-"):
            return options, [arg], argv[i + 1 :]
        else:
            return None
        i += 1
    return None


def main() -> None:
    if not REAL or not SOCKET:
        fresh()
    parsed = parse(sys.argv[1:])
    if parsed is None:
        fresh("command line")
    extra = [fd for fd in os.listdir("/proc/self/fd") if int(fd) > 2]
    if len(extra) > 1:  # the one listdir itself opened
        fresh("descriptors to pass on")
    options, target, args = parsed
    sockets = SOCKET.split(os.pathsep)
    local_rank = os.environ.get("LOCAL_RANK", "0")
    sock = sockets[int(local_rank) % len(sockets) if local_rank.isdigit() else 0]
    executable = os.path.abspath(sys.argv[0])
    request = {"options": options, "target": target, "args": args, "env": dict(os.environ), "cwd": os.getcwd()}
    request["executable"] = executable
    payload = json.dumps(request).encode()
    # Held from the request until they can be passed on: the program may run (and its launcher signal this
    # process) before the server's pid line is read here, and a signal then would end this process, not the program.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(sock)
        socket.send_fds(conn, [len(payload).to_bytes(8, "little")], [0, 1, 2])
        conn.sendall(payload)
    except OSError as e:
        conn.close()
        fresh(f"server: {e}")
    reader = conn.makefile("rb")
    first = reader.readline().decode().split()
    if not first or first[0] != "pid":
        conn.close()
        fresh(" ".join(first[1:]) or "server closed")
    program = int(first[1])

    def forward(signum: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(program, signum)

    for signum in FORWARDED:
        signal.signal(signum, forward)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # what came meanwhile is delivered now, and passed on
    last = reader.readline().decode().split()
    if not last:  # the server's monitor is gone: nothing to report
        os._exit(70)
    status = int(last[1])
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum != signal.SIGKILL:  # whose action cannot be set, nor caught
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        os._exit(128 + signum)
    os._exit(os.waitstatus_to_exitcode(status))


main()
