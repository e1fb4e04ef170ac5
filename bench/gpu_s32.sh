#!/bin/bash
# For the next device call (H100 or H200). carry [".whl"].
#   bash bench/gpu_s32.sh a   (~200 s) prefill whole / in chunks (seconds, peak memory) at
#        32k and 185k; the prefill attention GPU tests (chunk after cached chunks included);
#        batch 1 split counts at q 1 and q 16 (8k, 32k); the verify step at 512 and 185k
#   bash bench/gpu_s32.sh b   every GPU test (~200 s on an H100)
source bench/gpu_setup.sh

if [ "$1" = a ]; then
  timeout 150 python3 -m bench.prefill --contexts 32768 185000 --chunks 0 8192 2048 --reps 2 \
    --json-out "$OUT/prefill.json" 2>&1 | grep "^ctx"
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_prefill_attention.py \
    2>&1 | tail -2
  timeout 100 python3 -m bench.kernel_sweep --points 1:8192:1 1:32768:1 1:8192:16 1:32768:16 \
    --configs 64,4,3 32,4,3 --waves 0.5 1 1.5 2 3 4 --time-limit 90 \
    --out "$OUT/sweep_waves.json" 2>&1 | sed -n '/^summary/,$p'
  verify_ab 45 1
elif [ "$1" = b ]; then
  timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
fi
