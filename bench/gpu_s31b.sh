#!/bin/bash
# Session 31, call 3 (H100 or H200). carry [".whl"]. Split partials fp32 / fp16
# (SPLITFLASH_ATTN_PARTIALS, kernels/split_combine.py) alternated: the kernel bench at
# batch 1 (8k, 32k, 128k; q 1, 16), then the verify step at 512 and 185k; then the GPU tests
# of the paged and draft kernels with fp16 partials.
source bench/gpu_setup.sh

for p in fp32 fp16 fp32 fp16; do
  SPLITFLASH_ATTN_PARTIALS=$p timeout 60 python3 -m bench.kernels --batch-sizes 1 \
    --kv-lens 8192,32768,131072 --q-lens 1,16 --out "$OUT/kernels_${p}_$SECONDS.json" 2>&1 \
    | grep "^│ 1 " | sed "s|^|$p |"
done
for p in fp32 fp16 fp32 fp16; do
  SPLITFLASH_ATTN_PARTIALS=$p timeout 45 python3 -m bench.verify_step --contexts 512 185000 \
    --q-lens 16 1 --reps 40 --json-out "$OUT/verify_step_${p}_$SECONDS.json" 2>&1 \
    | grep -E "\] ctx" | sed "s|^|$p |"
done
SPLITFLASH_ATTN_PARTIALS=fp16 timeout 90 python3 -m pytest -q -m gpu \
  tests/unit/test_kernels_paged.py tests/unit/test_kernels_draft.py 2>&1 | tail -2
