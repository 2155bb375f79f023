#!/usr/bin/env bash
# Create (or reuse) .venv with a CPU build of torch and modelpar installed editable. Idempotent.
# EXTRAS picks the optional dependencies ("dev" for the tests); VENV puts the environment elsewhere (default .venv;
# scripts/test-against.sh uses .venv-compat/<name>).
# LOCK: the constraints file every package is installed from (default requirements/ci.txt, the versions CI tests;
# a venv that holds others is brought back to them). LOCK= (empty) installs the newest releases the extras admit.
# TORCH_SPEC overrides the torch requirement (default: the lock's torch, the CPU wheel pip takes from the local disk
# here); the lock's other pins still apply. UPGRADE=1 upgrades every package but torch to the newest that the
# constraints allow (scripts/test-against.sh --latest).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOCK=${LOCK-requirements/ci.txt}
EXTRAS=${EXTRAS:-}
VENV=${VENV:-.venv}
UPGRADE=${UPGRADE:-}
locked_torch=""
if [ -n "$LOCK" ]; then
  locked_torch=$(grep -E '^torch==' "$LOCK" | head -n 1 || true)
fi
TORCH_SPEC=${TORCH_SPEC:-${locked_torch:-torch==2.13.0}}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: an unpinned torch pulled in as a dependency would fetch a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  pip install "$TORCH_SPEC"
fi
# The constraints: the lock without its torch line, and the torch this venv holds (never moved by what follows;
# its installed version as pip knows it: a CUDA wheel from PyPI says 2.12.0 where torch.__version__ says +cu130).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
if [ -n "$LOCK" ]; then
  grep -vE '^torch==' "$LOCK" >"$constraints"
fi
echo "torch==$("$VENV/bin/python" -c 'from importlib.metadata import version; print(version("torch"))')" >>"$constraints"
target="."
if [ -n "$EXTRAS" ]; then
  target=".[$EXTRAS]"
fi
if [ -n "$UPGRADE" ]; then
  pip install -e "$target" -c "$constraints" --upgrade --upgrade-strategy eager
else
  pip install -e "$target" -c "$constraints"
fi
