#!/usr/bin/env bash
# The README's second command (and what CI runs): set up .venv with the dev extras, check style and
# types, then run every test. Extra arguments go to pytest (after `-n 2`: `-n 0` runs in one process, for --pdb).
# `-n 2`: two pytest-xdist workers, one for the multi-process tests (tests/distributed, one after another) and one
# for the one-process tests beside them (tests/conftest.py says why).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,trainer bash scripts/setup-env.sh
.venv/bin/ruff check src tests examples benchmarks
.venv/bin/ruff format --check src tests examples benchmarks
.venv/bin/mypy
.venv/bin/python -m pytest -n 2 "$@"
