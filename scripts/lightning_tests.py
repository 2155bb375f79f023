"""Run Lightning's own ``ModelParallelStrategy`` tests against modelpar, on CPU processes.

Why: users switch by changing one import, so Lightning's tests of its strategy are a ready-made check of the public
behaviour modelpar must keep. They are not in Lightning's packages; give this script the ``tests/`` folder of a
checkout of Lightning's repository at the tag of the installed release (or any folder holding ``tests_fabric`` and
``tests_pytorch``):

    git -C pytorch-lightning archive 2.6.5 tests | tar -x -C /tmp/lightning-2.6.5
    python scripts/lightning_tests.py /tmp/lightning-2.6.5/tests [--theirs] [-k EXPR]

What it does, in a copy under a temporary folder (the checkout is not changed):

- In the four files (``tests_{fabric,pytorch}/strategies/test_model_parallel{,_integration}.py``), Lightning's
  strategy is replaced by ``modelpar.ModelParallelStrategy`` / ``modelpar.trainer.ModelParallelStrategy`` (left as it
  is with ``--theirs``, for a baseline of the same tests on CPU).
- The integration tests are written for CUDA (``RunIf(min_cuda_gpus=...)``); their ``RunIf`` marks are dropped and
  their devices turned into CPU ones, so they run as gloo processes. Each runs in a pytest process of its own, as
  Lightning's standalone tests do: Fabric's and the Trainer's launchers start the other ranks by running the same
  pytest command again.
- So does each unit test (a few seconds each).

It prints one line per test (``pass``/``FAIL`` and the seconds) and the first error lines of each failure, and
exits non-zero if any failed. Many of Lightning's unit tests patch its module's internals (``mock.patch(
"lightning.fabric.strategies.model_parallel._setup_device_mesh")``, ``strategy._device_mesh = Mock()``), which
modelpar does not have; docs/compatibility.md lists what failed and why at the last run.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FILES = {
    "fabric": (
        "tests_fabric/strategies/test_model_parallel.py",
        "tests_fabric/strategies/test_model_parallel_integration.py",
    ),
    "pytorch": (
        "tests_pytorch/strategies/test_model_parallel.py",
        "tests_pytorch/strategies/test_model_parallel_integration.py",
    ),
}
OURS = {
    "fabric": (
        r"^from lightning\.fabric\.strategies import ModelParallelStrategy$",
        "from modelpar import ModelParallelStrategy",
        r"^from lightning\.fabric\.strategies\.model_parallel import ModelParallelStrategy, (\w+)$",
        "from modelpar import ModelParallelStrategy\nfrom lightning.fabric.strategies.model_parallel import \\1",
    ),
    "pytorch": (
        r"^from lightning\.pytorch\.strategies import ModelParallelStrategy$",
        "from modelpar.trainer import ModelParallelStrategy",
    ),
}
TIMEOUT = 300  # seconds per integration test (4 ranks on 2 cores: under a minute each)


def convert(text: str, *, ours: bool, framework: str, integration: bool) -> str:
    if ours:
        subs = OURS[framework]
        for pattern, replacement in zip(subs[::2], subs[1::2], strict=True):
            text = re.sub(pattern, replacement, text, flags=re.M)
    if integration:
        text = re.sub(r"^@RunIf\(.*\)\n", "", text, flags=re.M)
        text = re.sub(r",\s*marks=RunIf\([^)]*\)", "", text)
        for accelerator in ("cuda", "gpu", "auto"):
            text = text.replace(f'accelerator="{accelerator}"', 'accelerator="cpu"')
        text = text.replace('"accelerator": "cuda"', '"accelerator": "cpu"')
        text = re.sub(r'torch\.device\("cuda", (fabric|self)\.local_rank\)', 'torch.device("cpu")', text)
        text = text.replace('init_device_mesh("cuda"', 'init_device_mesh("cpu"').replace('== "cuda"', '== "cpu"')
    return text


def pytest(root: Path, env: dict[str, str], *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)


def collect(root: Path, path: str, env: dict[str, str]) -> list[str]:
    return [line for line in pytest(root, env, "--collect-only", path).stdout.splitlines() if "::" in line]


def run(root: Path, target: str, env: dict[str, str], timeout: float) -> tuple[bool, float, list[str]]:
    start = time.monotonic()
    try:
        done = pytest(root, env, "-x", target, timeout=timeout)
        output, ok = done.stdout + done.stderr, done.returncode == 0
    except subprocess.TimeoutExpired as expired:
        output, ok = f"timed out after {timeout:g} s\n{expired.stdout or ''}", False
    errors = [line for line in output.splitlines() if line.startswith("E ") or "Error:" in line][:12]
    return ok, time.monotonic() - start, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="Lightning's tests/ folder (holding tests_fabric, tests_pytorch)")
    parser.add_argument("--theirs", action="store_true", help="keep Lightning's strategy: a baseline on CPU")
    parser.add_argument("-k", default="", help="run only the tests whose id contains this")
    args = parser.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory(prefix="lightning-tests-") as tmp:
        root = Path(tmp) / "tests"
        shutil.copytree(args.tests, root)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        env.pop("PL_RUN_STANDALONE_TESTS", None)  # the integration tests lost their standalone marks
        for framework, (unit, integration) in FILES.items():
            for path, is_integration in ((unit, False), (integration, True)):
                source = root / path
                text = convert(
                    source.read_text(), ours=not args.theirs, framework=framework, integration=is_integration
                )
                source.write_text(text)
                for target in [t for t in collect(root, path, env) if args.k in t]:
                    ok, seconds, errors = run(root, target, env, TIMEOUT)
                    print(f"{'pass' if ok else 'FAIL'} {seconds:6.1f} s  {target}", flush=True)
                    if not ok:
                        failed += 1
                        print("".join(f"        {line}\n" for line in errors), end="", flush=True)
    print(f"{failed} failed" if failed else "all passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
