#!/usr/bin/env bash
# Create (or reuse) .venv with a CPU build of torch and modelpar installed editable. Idempotent.
# EXTRAS picks the optional dependencies ("dev" for the tests); TORCH_SPEC overrides the torch requirement
# (the default pin matches the CPU wheel this project is tested with; pip takes it from the local disk here);
# VENV puts the environment elsewhere (default .venv; scripts/test-against.sh uses .venv-compat/<name>).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
EXTRAS=${EXTRAS:-}
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first and pinned: an unpinned torch pulled in as a dependency would fetch a multi-GB CUDA build.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  pip install "$TORCH_SPEC"
fi
if [ -n "$EXTRAS" ]; then
  pip install -e ".[$EXTRAS]"
else
  pip install -e .
fi
