#!/bin/bash
# For the next device call (H100 or H200), carry [".whl"]. Session 35's CPU-only work, to be
# checked on a GPU:
#   bash bench/gpu_s35.sh a   (~200 s) prefill chunks split through FlashAttention below
#        chunk_attention.CUDNN_MIN_WORK: its GPU tests (bf16 against fp32 masked SDPA, the
#        LSE check), the backend probe (whole prompts too), the 185k prompt in chunks of 8192
#        and in 100 ms chunks, and short prompts packed into one forward (bench.prefill_pack)
#   bash bench/gpu_s35.sh b   (~290 s) every GPU test
source bench/gpu_setup.sh

if [ "$1" = a ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_chunk_attention.py \
    tests/unit/test_prefill_chunks.py tests/unit/test_prefill_attention.py 2>&1 | tail -2
  timeout 50 python3 -m bench.chunk_backend_probe 2>&1 | tail -16
  timeout 40 python3 -m bench.prefill_pack --shape smollm2-135m --prompts 1 4 16 --tokens 200 \
    --reps 4 --json-out "$OUT/prefill_pack.json" 2>&1 | tail -3
  timeout 100 python3 -m bench.prefill --shape smollm2-135m --contexts 2048 32768 185000 \
    --chunks 0 8192 --chunk-ms 100 --reps 2 --json-out "$OUT/prefill_s35.json" 2>&1 | grep "^ctx"
elif [ "$1" = b ]; then
  timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
fi
