#!/usr/bin/env bash
# Run what scripts/test.sh runs (ruff, mypy, pytest) against another torch, Lightning or any other release, or
# against the newest releases of everything, in a venv of its own under .venv-compat/<name> (git-ignored; .venv
# is left alone). Extra arguments go to pytest.
#
#   bash scripts/test-against.sh --latest                       # before a change lands: today's releases, no lock
#   TORCH_SPEC=torch==2.14.1 bash scripts/test-against.sh
#   LIGHTNING_SPEC=2.6.1 bash scripts/test-against.sh -x          # torch stays at the default pin
#   PINS='transformers==5.17.0' bash scripts/test-against.sh     # the hf extra's floor
#   TORCH_SPEC=torch==2.12.0 LIGHTNING_SPEC='~=2.5.0' bash scripts/test-against.sh
#
# Without --latest the venv installs from the lock (requirements/ci.txt, what CI tests) but for what is named
# here. --latest installs without the lock and upgrades every package but torch to its newest release on each
# run, so that a break in a new release is seen the day it is published, not by a user (or by CI, which the lock
# keeps green): run it before each change lands, and update the lock with scripts/lock.sh once it passes.
# PINS: pip requirements (space-separated) installed last, like LIGHTNING_SPEC, with torch held.
#
# TORCH_SPEC: a pip requirement for torch (default: the lock's, the CPU build on the local disk); other
# releases come from PyPI as CUDA builds (several GB with their nvidia-* dependencies; they run on CPU). torch is
# held at that release while modelpar installs, so one below pyproject.toml's floor is refused by pip
# (ResolutionImpossible): lower the floor in the working tree first to try it.
# LIGHTNING_SPEC: a version ("2.6.1") or a specifier ("~=2.5.0") for lightning-fabric, pytorch-lightning and,
# when the dev extra installed it, lightning. It is installed after modelpar, so it may go below the floors in
# pyproject.toml (pip then reports the conflict, which is the point). COMPAT_NAME names the venv (default: from
# the specs). Every step runs even when an earlier one fails; the exit status is non-zero if any failed.
# A venv is reused by the next run with the same specs; remove it with rm -r .venv-compat/<name>.
set -uo pipefail
cd "$(dirname "$0")/.."
LATEST=""
if [ "${1:-}" = "--latest" ]; then
  LATEST=1
  shift
fi
TORCH_SPEC=${TORCH_SPEC:-$(grep -E '^torch==' requirements/ci.txt | head -n 1)}
LIGHTNING_SPEC=${LIGHTNING_SPEC:-}
PINS=${PINS:-}
if [[ -n "$LIGHTNING_SPEC" && "$LIGHTNING_SPEC" =~ ^[0-9] ]]; then
  LIGHTNING_SPEC="==$LIGHTNING_SPEC"
fi
default_name="$TORCH_SPEC${LIGHTNING_SPEC:+_lightning$LIGHTNING_SPEC}${PINS:+_$PINS}${LATEST:+_latest}"
NAME=${COMPAT_NAME:-$(printf '%s' "$default_name" | sed -E 's/==/-/g; s/[^A-Za-z0-9.+-]+/_/g')}
VENV=.venv-compat/$NAME
mkdir -p .venv-compat

if [ -n "$LATEST" ]; then
  VENV="$VENV" TORCH_SPEC="$TORCH_SPEC" LOCK= UPGRADE=1 EXTRAS=dev,trainer bash scripts/setup-env.sh || exit
else
  VENV="$VENV" TORCH_SPEC="$TORCH_SPEC" EXTRAS=dev,trainer bash scripts/setup-env.sh || exit
fi
py="$VENV/bin/python"
if ! "$py" - "$TORCH_SPEC" <<'EOF'; then
import sys

import torch
from pip._vendor.packaging.requirements import InvalidRequirement, Requirement
from pip._vendor.packaging.version import Version

try:
    req = Requirement(sys.argv[1])
except InvalidRequirement:  # a wheel path or URL: nothing to compare
    sys.exit(0)
if not req.specifier.contains(Version(torch.__version__.split("+")[0]), prereleases=True):
    sys.exit(f"{sys.argv[1]!r} asked for, but the venv holds torch {torch.__version__}: remove it and run again.")
EOF
  exit 1
fi
if [ -n "$LIGHTNING_SPEC" ]; then
  lightning_pins=("lightning-fabric$LIGHTNING_SPEC" "pytorch-lightning$LIGHTNING_SPEC")
  if "$py" -m pip --disable-pip-version-check -q show lightning >/dev/null 2>&1; then
    lightning_pins+=("lightning$LIGHTNING_SPEC")  # the unified package carries its own copy of both
  fi
  torch_pin="torch==$("$py" -c 'from importlib.metadata import version; print(version("torch"))')"  # never let Lightning move torch
  "$py" -m pip --disable-pip-version-check -q install "${lightning_pins[@]}" "$torch_pin" || exit
fi
if [ -n "$PINS" ]; then
  read -r -a pins <<<"$PINS"
  "$py" -m pip --disable-pip-version-check -q install "${pins[@]}" \
    "torch==$("$py" -c 'from importlib.metadata import version; print(version("torch"))')" || exit
fi
"$py" - "$VENV" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

found = []
for name in ("torch", "lightning-fabric", "pytorch-lightning", "lightning", "transformers", "safetensors"):
    try:
        found.append(f"{name} {version(name)}")
    except PackageNotFoundError:
        pass
print(f"== {sys.argv[1]}: {', '.join(found)}")
EOF

failed=()
# Caches go into the venv: results for one torch must not be reused for another.
"$VENV/bin/ruff" check --cache-dir "$VENV/.ruff_cache" src tests examples benchmarks || failed+=("ruff check")
"$VENV/bin/ruff" format --check --cache-dir "$VENV/.ruff_cache" src tests examples benchmarks || failed+=("ruff format")
MYPY_CACHE_DIR="$VENV/.mypy_cache" "$VENV/bin/mypy" || failed+=(mypy)
"$py" -m pytest -n 2 -o cache_dir="$VENV/.pytest_cache" "$@" || failed+=(pytest)
if [ ${#failed[@]} -gt 0 ]; then
  echo "== $VENV: failed: ${failed[*]}"
  exit 1
fi
echo "== $VENV: all passed"
