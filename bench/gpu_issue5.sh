#!/usr/bin/env bash
# One device call for issue 5 (and issue 4's draft step), in order of importance, each step
# time-boxed so the table of every finished step comes back. Carry: .whl
#   1. the end-to-end verify step of the default model's shape: eager vs CUDA graph, short
#      context and 185k, against the bytes floor (bench/verify_step.py);
#   2. the GPU tests (bf16 kernels, captured graphs == eager);
#   3. the paged-attention config/split sweep and the kernel table (q_len 1/16/64);
#   4. the DFlash draft step at 2k/32k/128k, window on/off (bench/drafter_step.py).
set -uo pipefail
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
timeout 140 python3 -m bench.verify_step --json-out "$OUT/verify_step.json"
timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit 2>&1 | tail -6
timeout 50 python3 -m bench.kernel_sweep --quick --time-limit 40 --out "$OUT/sweep.json" \
  2>&1 | tail -14
timeout 75 python3 -m bench.kernels --batch-sizes 1,8 --kv-lens 32768,131072 --q-lens 1,16,64 \
  --out "$OUT/kernels.json" 2>&1 | tail -16
timeout 40 python3 -m bench.drafter_step --device cuda --reps 20 \
  --json-out "$OUT/drafter_step.json" 2>&1 | tail -12
