#!/usr/bin/env bash
# Issue 29 on a GPU, after scripts/gpu-check.sh: where float8's gain goes (and, in `setup`, issue 25's set-up
# ratio). On an H200 (2026-11-28) float8 tensorwise trained at 1.12x bf16's tokens/s on the 1.07B model (the goal:
# 1.2x; roofline about 1.25x) and 1.22x at dim 4096; its multiplies ran at their roofline and its casts at 2-2.5x
# theirs. These steps say where the rest goes.
# Each starts only if its estimate (H200 figures) fits in what is left of FLOAT8_BUDGET seconds (default 540: a lent
# machine's 10-minute call less a margin), in this order, the one that answers most first:
#   profile-1b  bench_mfu.py --profile 3 on the 1.07B model (AC selective, as gpu-check.sh runs it): modelpar in bf16
#            and in float8 tensorwise, each kernel kind's milliseconds (the casts: Triton and copies), 2 runs, ~90 s
#   setup    issue 25's set-up ratio on a GPU (0.86x on 2026-11-27; 1.70x in one run of 2026-11-28 whose other
#            modelpar runs gave 1.02-1.09x): bench_mfu.py --setup-only, modelpar and Lightning, 4 rounds of the
#            set-up alone (timed after torch.compile's imports, which are reported beside it), then one round under
#            cProfile (--profile-setup 25: where each one's seconds go), 10 runs of ~13 s, ~140 s
#   repeats  the goal's figure with its spread: tensorwise against bf16 on the 1.07B model in 3 rounds, then at
#            dim 4096 (AC none) in 2: whether 2026-11-28's one-run ratios and the 2.29% loss gap at dim 4096
#            hold (10 runs, ~330 s)
#   gemm     the float8 multiplies alone (bench_float8_gemm.py; torch only) at the dim-4096 model's shapes, then at
#            the 1.07B model's (~20 s each): do the kernels reach float8's rate on this stack?
#   profile  bench_mfu.py --profile 3 at dim 4096 (Llama 3 8B's layer shapes, 4 layers, AC none): modelpar and
#            torch by hand in bf16, torchao applied by hand (torch-float8-tensorwise), modelpar's tensorwise (on
#            one GPU its weights gathered in bf16, the default since 2026-11-28) and tensorwise with FSDP2's float8
#            all-gather forced on (5 runs, ~330 s). By hand as slow as modelpar: float8 itself falls short here;
#            faster: the difference is modelpar's. The forced all-gather: what its eager casts cost on one rank,
#            where nothing is gathered. The profile's `busy` against `step`, with the host's operator and kernel
#            counts: whether the GPU waits on the host.
#   rowwise  the same profile for the rowwise recipe (2 runs, ~150 s).
# gemm, profile and rowwise ran on 2026-11-28 (benchmarks/gpu-runs/2026-11-28-h200/). Name steps to run only those
# (`bash scripts/gpu-float8.sh profile rowwise`); the default runs every step, in the order above, as the budget
# allows. Each step's output is written to $GPU_CHECK_OUT/float8/ (default gpu-check-results/float8/) as it runs, so that a call
# stopped at its limit still returns what ran; the last lines say which steps ran, with their seconds, and which
# were left out and why. torchao comes from PYTHON's environment or PYTHONPATH, as for gpu-check.sh (docs/gpu.md
# says how to carry its wheel to a machine without a package index). FLOAT8_SMOKE=1 runs the same steps on a tiny
# model without a GPU (emulated float8): the script's own check, whose figures mean nothing.
set -uo pipefail
started=$SECONDS
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${GPU_CHECK_OUT:-gpu-check-results}/float8
BUDGET=${FLOAT8_BUDGET:-540}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

# The models: the dim-4096 one for the profiles and the first multiplies, the 1.07B one (the benchmark's default,
# issue 29's goal) for the second. FLOAT8_SMOKE=1: tiny ones, few steps, no compile.
wide=(--dim 4096 --heads 32 --kv-heads 8 --ffn 14336 --layers 4)
default=()
run=(--ac none --repeats 1 --profile 3)
quick=()
gemm=()
if [ "${FLOAT8_SMOKE:-0}" = "1" ]; then
  wide=(--dim 64 --heads 4 --kv-heads 2 --ffn 128 --layers 2 --vocab 256)
  default=(--dim 32 --heads 2 --kv-heads 1 --ffn 64 --layers 2 --vocab 256)
  quick=(--no-compile --peak-tflops 1 --batch 2 --seq 32 --steps 3 --warmup 1)
  run+=("${quick[@]}")
  gemm=(--tokens 64 --iters 2 --repeats 1)
elif ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu-float8: $PYTHON has no CUDA build of torch, or no GPU is visible (FLOAT8_SMOKE=1 checks this script on CPU)." >&2
  exit 2
fi
if ! why=$("$PYTHON" -c "import torchao.float8" 2>&1); then
  echo "gpu-float8: torchao cannot be imported by $PYTHON (${why##*$'\n'}): see docs/gpu.md, 'torchao on a machine" \
    "without a package index'." >&2
  exit 2
fi

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(profile-1b setup repeats gemm profile rowwise)
declare -A estimate=([profile-1b]=90 [setup]=140 [repeats]=330 [gemm]=45 [profile]=330 [rowwise]=150)
for step in "${steps[@]}"; do
  [ -n "${estimate[$step]+x}" ] || {
    echo "gpu-float8: unknown step '$step': choose from profile-1b, repeats, gemm, profile, rowwise" >&2
    exit 2
  }
done

status=0
ran=()
left=()
for step in "${steps[@]}"; do
  spent=$((SECONDS - started))
  if [ $((spent + estimate[$step])) -gt "$BUDGET" ]; then
    left+=("$step (needs ~${estimate[$step]} s, ${spent} s of FLOAT8_BUDGET=$BUDGET spent)")
    continue
  fi
  step_started=$SECONDS
  case $step in
    profile-1b)
      "$PYTHON" benchmarks/bench_mfu.py ${default[@]+"${default[@]}"} --repeats 1 --profile 3 --variants modelpar \
        --float8 tensorwise ${quick[@]+"${quick[@]}"} 2>&1 | tee "$OUT/profile-1b.txt" ;;
    setup)
      # the set-up alone in 4 rounds, then one round under cProfile; the step fails if either did
      ( "$PYTHON" benchmarks/bench_mfu.py ${default[@]+"${default[@]}"} --setup-only --repeats 4 \
          --variants modelpar,lightning ${quick[@]+"${quick[@]}"}; first=$?
        "$PYTHON" benchmarks/bench_mfu.py ${default[@]+"${default[@]}"} --setup-only --repeats 1 --profile-setup 25 \
          --variants modelpar,lightning ${quick[@]+"${quick[@]}"} && exit "$first"
      ) 2>&1 | tee "$OUT/setup.txt" ;;
    repeats)
      # both models, the second whatever the first gave; the step fails if either did
      ( "$PYTHON" benchmarks/bench_mfu.py ${default[@]+"${default[@]}"} --repeats 3 --variants modelpar \
          --float8 tensorwise ${quick[@]+"${quick[@]}"}; first=$?
        "$PYTHON" benchmarks/bench_mfu.py "${wide[@]}" --ac none --repeats 2 --variants modelpar --float8 tensorwise \
          ${quick[@]+"${quick[@]}"} && exit "$first"
      ) 2>&1 | tee "$OUT/repeats.txt" ;;
    gemm)
      # both models' shapes, the second whatever the first gave; the step fails if either did
      ( "$PYTHON" benchmarks/bench_float8_gemm.py "${wide[@]}" ${gemm[@]+"${gemm[@]}"}; first=$?
        "$PYTHON" benchmarks/bench_float8_gemm.py ${default[@]+"${default[@]}"} ${gemm[@]+"${gemm[@]}"} && exit "$first"
      ) 2>&1 | tee "$OUT/gemm.txt" ;;
    profile)
      "$PYTHON" benchmarks/bench_mfu.py "${wide[@]}" "${run[@]}" --variants modelpar,torch,torch-float8-tensorwise \
        --float8 tensorwise,tensorwise-float8gather 2>&1 | tee "$OUT/profile.txt" ;;
    rowwise)
      "$PYTHON" benchmarks/bench_mfu.py "${wide[@]}" "${run[@]}" --float8 rowwise 2>&1 | tee "$OUT/rowwise.txt" ;;
  esac
  step_status=${PIPESTATUS[0]}
  [ "$step_status" -eq 0 ] || status=1
  ran+=("$step (exit $step_status, $((SECONDS - step_started)) s)")
done

{
  echo "gpu-float8: ran ${ran[*]:-nothing}; $((SECONDS - started)) s in all; output in $OUT/"
  [ ${#left[@]} -eq 0 ] || printf 'gpu-float8: left out %s\n' "${left[@]}"
} | tee "$OUT/done.txt"
exit "$status"
