"""Session-wide fixtures: the S3-compatible server for the object-storage tests (see ``object_store``); and, under
pytest-xdist (``scripts/test.sh`` runs ``-n 2``), which worker runs what."""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

import warm_python
from object_store import S3Server, s3_environment, start_s3_server

_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


def _user() -> str:
    """The user name as inductor's default cache folder spells it (torch's ``default_cache_dir``: characters a
    path cannot hold as ``_``; ``uid_N`` where the system knows no name for the user)."""
    try:
        name = getpass.getuser()
    except (KeyError, ModuleNotFoundError, OSError):
        name = f"uid_{os.getuid()}"
    return re.sub(r'[\\/:*?"<>|]', "_", name)


@pytest.fixture(scope="session", autouse=True)
def _scratch_in_pytests_tree(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every temporary file of this process, its ranks and the programs it launches (``TMPDIR``), the folders the
    tests' helpers make for themselves (``trainer_module``) included, goes under pytest's temporary tree, which
    pytest prunes (it keeps the last three runs).

    Not only our own: torchrun's agent makes a ``torchelastic_*`` folder in the temporary directory for every launch
    and leaves it there (about 5 a run of the suite).
    """
    scratch = str(tmp_path_factory.mktemp("scratch"))
    saved = {name: os.environ.get(name) for name in ("TMPDIR", _INDUCTOR_CACHE)}
    # inductor's compile cache is a cache, kept across runs on purpose: it stays where torch puts it by default
    # (torch's default_cache_dir(), from the temporary directory as it was), not in a folder pytest prunes.
    os.environ.setdefault(_INDUCTOR_CACHE, os.path.join(tempfile.gettempdir(), "torchinductor_" + _user()))
    os.environ["TMPDIR"] = scratch
    tempfile.tempdir = None  # this process reads TMPDIR again at its next temporary file
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    tempfile.tempdir = None


@pytest.fixture(scope="session")
def program_python(_scratch_in_pytests_tree: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The ``python`` the tests launch programs with (examples, documented programs, ``torchrun`` scripts): a warm
    one (:mod:`warm_python`) on a machine without CUDA, else ``sys.executable``. The programs' environment must hold
    ``OMP_NUM_THREADS=1``, as the tests give it, to run warm (torch's thread pool is sized at import)."""
    import torch

    if torch.cuda.is_available():  # a fork of a process that may have touched CUDA is no place to start one
        yield sys.executable
        return
    warm, why = warm_python.start(tmp_path_factory.mktemp("warm_python"), {**os.environ, "OMP_NUM_THREADS": "1"})
    if warm is None:
        warnings.warn(f"programs start in fresh interpreters: {why}", stacklevel=1)
        yield sys.executable
        return
    try:
        with pytest.MonkeyPatch.context() as patch:  # exported to the programs while the session runs
            for key, value in warm.env.items():
                patch.setenv(key, value)
            yield warm.executable
    finally:
        warm.close()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One server for the session, exported through the ``AWS_*`` variables; skips the test without one."""
    server, why = start_s3_server()
    if server is None:
        pytest.skip(f"no S3-compatible server: {why}")
    with s3_environment(server):
        yield server
    server.close()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """``s3://<a fresh bucket>`` on the session's server."""
    return s3_server.new_bucket()


#: The test folder whose tests start several processes each: under xdist they run one after another on one worker,
#: as without it, since their launchers and timeouts are timed (a rank's death seen within seconds ...).
PROCESS_FOLDER = "tests/distributed/"
#: The exceptions: the README's, the docs' and the examples' programs, run as a user runs them (their command line,
#: through the warm ``python`` of :func:`program_python`). They run on the other worker, with the one-process tests,
#: beside the process tests: each side gets the core time the other leaves idle.
PROGRAMS = ("test_docs_run.py", "test_examples.py", "test_hf_examples.py")
#: Tests of the process folder that launch programs (through the warm ``python``, whose servers run on this worker)
#: or use the S3 server (so that only this worker starts one), and float8's grid: they run beside the process tests,
#: which balances the two workers (once the programs ran warm, the process side took 784 s and this side 419 s on 2
#: cores). Their bounds are generous (the rank-death launches': 20 s from the signal, for a 3 s peer timeout).
BESIDE = (
    "tests/distributed/test_standalone.py::test_standalone_under_torchrun_detects_environment_and_matches_reference",
    "tests/distributed/test_standalone.py::test_standalone_on_two_simulated_nodes_resolves_auto_to_2x2",
    "tests/distributed/test_checkpoint_run.py::",
    "tests/distributed/test_checkpoint_remote.py::",
    "tests/distributed/test_float8.py::",
    "tests/distributed/test_rank_death.py::",
)
#: One-process tests that time threads (a heartbeat seen within a few seconds): they run with the process tests, one
#: after another, as before. Beside a 4-rank spawn, two of them failed once on torch 2.11 (passing alone).
TIMED = ("tests/unit/test_watchdog.py",)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: without it installed, nothing calls this
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Two workers (``scripts/test.sh`` runs ``-n 2``): one runs the tests of :data:`PROCESS_FOLDER` and :data:`TIMED`, the other
    :data:`PROGRAMS`, :data:`BESIDE` and the one-process tests; each in collection order (module-scoped
    spawns are shared as before).

    On 2 cores the serial suite left a fifth of its core time idle (a launcher importing torch, a one-process
    test's single thread); on two workers, 7-12% (the CHANGELOG has the timings). The scheduler
    is xdist's own scope scheduler with one scope per side (pytest-xdist 3.8's ``--dist loadgroup`` cannot group
    under pytest 9.2, whose test ids it no longer rewrites).
    """
    from xdist.scheduler import LoadScopeScheduling

    class TwoSides(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if nodeid.startswith(BESIDE):
                return "beside"
            if path in TIMED or (path.startswith(PROCESS_FOLDER) and path.rsplit("/", 1)[-1] not in PROGRAMS):
                return "processes"
            return "beside"

    return TwoSides(config, log)
