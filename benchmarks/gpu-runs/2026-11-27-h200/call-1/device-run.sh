#!/usr/bin/env bash
# One prepared device call (2026-11-27): gpu-check.sh, then extra benchmark runs while the internal budget lasts.
set -u
T0=$SECONDS
BUDGET=${BUDGET:-560}
R=/tmp/r; mkdir -p "$R"
left() { echo $((BUDGET - (SECONDS - T0))); }
log() { echo "[device-run] $((SECONDS - T0)) s: $*" | tee -a "$R/steps.txt"; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site || log "torchao install failed"
export PYTHONUNBUFFERED=1
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
python3 -c "import torchao, torch; print('torchao', torchao.__version__, 'torch', torch.__version__)" 2>&1 | tail -1 | tee -a "$R/steps.txt"
log "gpu-check starts"
GPU_CHECK_OUT=$R/gc GPU_CHECK_FLOAT8=tensorwise timeout $(( $(left) - 30 )) bash scripts/gpu-check.sh --timeout 300 > "$R/gpu-check.log" 2>&1
log "gpu-check exit $?"
cp "$R/gc/summary.txt" "$OUT/summary.txt" 2>/dev/null || tail -60 "$R/gpu-check.log" > "$OUT/summary.txt"
extra() {  # name, predicted seconds, command...
  local name=$1 need=$2; shift 2
  if [ "$(left)" -lt $((need + 15)) ]; then log "$name not run ($(left) s left, needs ~$need)"; return; fi
  log "$name starts"
  timeout $(( $(left) - 10 )) "$@" > "$R/$name.txt" 2>&1
  log "$name exit $?"
  grep -E "^\[summary\]|tokens/s|MFU|x torch|x Lightning|estimate" "$R/$name.txt" | tail -25 >> "$OUT/extras.txt"
}
extra ac-none 80 python3 benchmarks/bench_mfu.py --ac none --repeats 1
extra float8-rowwise 90 python3 benchmarks/bench_mfu.py --float8 rowwise --repeats 1
extra torch-partial 60 python3 benchmarks/bench_mfu.py --variants torch,torch-partial --repeats 1
extra sweep 120 python3 benchmarks/bench_mfu.py --sweep --ac none --sweep-tokens 16384,32768
tar czf "$OUT/results.tgz" -C "$R" .
log "done"
cp "$R/steps.txt" "$OUT/steps.txt"
