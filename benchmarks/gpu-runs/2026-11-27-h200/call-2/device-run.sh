#!/usr/bin/env bash
# Second device call (2026-11-27): the shared-device file after the probe fix, then float8 against bf16 at two sizes.
set -u
T0=$SECONDS
BUDGET=${BUDGET:-380}
R=/tmp/r; mkdir -p "$R"
left() { echo $((BUDGET - (SECONDS - T0))); }
log() { echo "[device-run] $((SECONDS - T0)) s: $*" | tee -a "$R/steps.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=$PWD/src:/tmp/site || log "torchao install failed"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
log "shared-device starts"
GPU_CHECK_OUT=$R/gc GPU_CHECK_SKIP_MFU=1 timeout 170 bash scripts/gpu-check.sh -k "shared_device or suite_itself" --timeout 150 > "$R/gpu-check.log" 2>&1
log "shared-device exit $?"
cp "$R/gc/summary.txt" "$OUT/summary.txt" 2>/dev/null || tail -60 "$R/gpu-check.log" > "$OUT/summary.txt"
extra() {  # name, predicted seconds, command...
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt $((need + 10)) ]; then log "$name not run ($(left) s left, needs ~$need)"; return; fi
  log "$name starts"
  timeout $(( $(left) - 8 )) "$@" > "$R/$name.txt" 2>&1
  log "$name exit $?"
  { echo "== $name"; grep -E "^\[summary\]|^\| |vs torch|/ torch|Error" "$R/$name.txt" | tail -30; } >> "$OUT/extras.txt"
}
extra f8-big 110 python3 benchmarks/bench_mfu.py --float8 tensorwise,rowwise --ac none --repeats 1 \
  --dim 4096 --heads 32 --kv-heads 8 --ffn 14336 --layers 4
extra f8-1b-acnone 110 python3 benchmarks/bench_mfu.py --float8 tensorwise,rowwise --ac none --repeats 1
tar czf "$OUT/results.tgz" -C "$R" .
log "done"
cp "$R/steps.txt" "$OUT/steps.txt"
