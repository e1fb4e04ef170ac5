#!/usr/bin/env bash
# One time-boxed device call for issue 5 (and issue 4's draft step), most important first, so
# every finished step's table comes back even if the call is cut short. Carry: .whl
#   1. the end-to-end verify step of the default model's shape: eager vs CUDA graph, short
#      context and 185k, against the bytes floor (one pinned tile config: one compile each);
#   2. the paged-attention config x split sweep, q_len 16 and 64 (bench/kernel_sweep.py);
#   3. the captured-graph test (graph replay == eager) on the GPU;
#   4. the DFlash draft step at 2k and 128k, window on/off, drafter on its Triton backend.
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
SPLITFLASH_KERNEL_CONFIG=64,4,3 timeout 70 python3 -m bench.verify_step --contexts 512 185000 \
  --q-lens 16 --reps 30 --json-out "$OUT/verify_step.json"
timeout 45 python3 -m bench.kernel_sweep --quick --time-limit 35 --out "$OUT/sweep.json" 2>&1 \
  | tail -16
SPLITFLASH_KERNEL_CONFIG=64,4,3 timeout 30 python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/unit/test_verify_graphs.py 2>&1 | tail -3
timeout 30 python3 -m bench.drafter_step --device cuda --contexts 2048 131072 --reps 10 \
  --json-out "$OUT/drafter_step.json" 2>&1 | tail -9
