#!/usr/bin/env bash
# The README's first command: set up .venv, then train a Llama-style model at data_parallel=2 x
# tensor_parallel=2 on 4 CPU processes, checkpoint at step 5, and resume from it in a second run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-env.sh
rm -rf checkpoints/demo && mkdir -p checkpoints/demo
echo "== first run: train 10 steps, checkpoint after step 5 =="
.venv/bin/python examples/fabric/train_llama.py --checkpoint-dir checkpoints/demo
echo "== second run: resume from the step-5 checkpoint and continue =="
.venv/bin/python examples/fabric/train_llama.py --checkpoint-dir checkpoints/demo --resume
