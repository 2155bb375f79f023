#!/usr/bin/env bash
# Regenerate requirements/ci.txt, the constraints that scripts/test.sh (and so CI) installs from, with the newest
# releases modelpar's dev and trainer extras admit today (torch stays at the lock's, or TORCH_SPEC). Run it
# deliberately: after `bash scripts/test-against.sh --latest` passes, then commit the new lock with what it changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-compat/lock
rm -rf "$VENV"
mkdir -p .venv-compat
VENV="$VENV" LOCK= TORCH_SPEC="${TORCH_SPEC:-$(grep -E '^torch==' requirements/ci.txt | head -n 1)}" \
  EXTRAS=dev,trainer bash scripts/setup-env.sh
{
  echo "# Constraints for scripts/test.sh (the README's test command, what CI runs): every package of"
  echo "# \`.[dev,trainer]\` at the version the suite last passed with, so that a new upstream release cannot turn CI"
  echo "# red by itself. Made by scripts/lock.sh on $(date -u +%F) (Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())')); update it deliberately, after"
  echo "# \`bash scripts/test-against.sh --latest\` passes. torch: the CPU wheel pip takes from the local disk."
  "$VENV/bin/python" -m pip --disable-pip-version-check freeze --exclude-editable \
    | sed -E 's/^torch==([^+]*)\+.*/torch==\1/' | grep -viE '^(modelpar|pip|setuptools)=='
} >requirements/ci.txt
echo "== requirements/ci.txt: $(grep -vc '^#' requirements/ci.txt) packages"
