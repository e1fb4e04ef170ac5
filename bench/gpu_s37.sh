#!/bin/bash
# Session 37, on a GPU (carry [".whl"]):
#   bash bench/gpu_s37.sh h   (~60 s) the graph path's host parts (verify_step --breakdown)
#   bash bench/gpu_s37.sh a   (~420 s) session 36's queued run of the aligned cuDNN rule
#        (gpu_s36.sh b); a server's first 185k prompt with and without the start-up warm-up's prefill part, each in a fresh
#        process with an empty Triton cache; every GPU test
#   bash bench/gpu_s37.sh w   (~150 s) a without gpu_s36.sh b, and only the GPU tests of the
#        chunk attention and the warm-ups
#   bash bench/gpu_s37.sh all (~230 s) every GPU test
source bench/gpu_setup.sh

if [ "$1" = h ]; then
  timeout 100 python3 -m bench.verify_step --contexts 512 185000 --q-lens 16 --reps 40 \
    --breakdown --json-out "$OUT/verify_step_breakdown_s37.json" 2>&1 | grep -v Warn | tail -9
elif [ "$1" = a ] || [ "$1" = w ]; then
  [ "$1" = a ] && bash bench/gpu_s36.sh b
  for w in "" --warm-up; do
    TRITON_CACHE_DIR=$(mktemp -d) timeout 100 python3 -m bench.prefill --shape smollm2-135m \
      --contexts 185000 --chunks 8192 --reps 1 $w --json-out "$OUT/prefill_first${w}_s37.json" \
      2>&1 | grep "^ctx\|warm-up"
  done
  if [ "$1" = w ]; then  # the GPU tests of this session's changes only
    timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_chunk_attention.py \
      tests/unit/test_warmup.py 2>&1 | tail -3
  else
    timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
  fi
elif [ "$1" = all ]; then
  timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
fi
