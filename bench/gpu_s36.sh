#!/bin/bash
# Session 36, on a GPU (carry [".whl"]): where cuDNN's per-shape cost falls in a prefill chunk
#   bash bench/gpu_s36.sh a   (~150 s) the probe of a new shape's first call against its next
#        ones, and the 185k prompt in chunks of 8192 with the shipped CUDNN_MIN_WORK
#        (3.5e11), 1.2e11, and 0 (every chunk through cuDNN)
#   bash bench/gpu_s36.sh b   (~90 s) the rule of chunk_attention.cudnn_pays (an aligned shape
#        asked for before goes to cuDNN): the 185k prompt in chunks of 8192 and in 100 ms
#        chunks, 3 runs each
#   bash bench/gpu_s36.sh t   (~30 s) the chunk attention's GPU tests
#   bash bench/gpu_s36.sh all (~230 s) every GPU test
source bench/gpu_setup.sh

if [ "$1" = a ]; then
  timeout 60 python3 -m bench.chunk_backend_probe --parts build 2>&1 | tail -4
  timeout 200 python3 -m bench.prefill --shape smollm2-135m --contexts 185000 --chunks 8192 \
    --cudnn-min-work 1.2e11 0 --reps 2 --json-out "$OUT/prefill_s36.json" 2>&1 | grep "^ctx"
elif [ "$1" = b ]; then
  timeout 150 python3 -m bench.prefill --shape smollm2-135m --contexts 185000 --chunks 8192 \
    --chunk-ms 100 --reps 3 --json-out "$OUT/prefill_s36b.json" 2>&1 | grep "^ctx"
elif [ "$1" = t ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_chunk_attention.py \
    tests/unit/test_prefill_chunks.py 2>&1 | tail -2
elif [ "$1" = all ]; then
  timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
fi
