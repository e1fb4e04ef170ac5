#!/bin/bash
# For the next device call (H100 or H200). carry [".whl"].
#   bash bench/gpu_s32.sh a   (~200 s) prefill whole / in chunks (seconds, the slowest chunk,
#        peak memory), random weights of the default model's shape at 32k and 185k and of
#        Llama-3-8B's at 32k; the prefill attention GPU tests (chunk after cached chunks
#        included); batch 1 split counts at q 1 and q 16 (8k, 32k); the verify step
#   bash bench/gpu_s32.sh b   every GPU test (~200 s on an H100)
#   bash bench/gpu_s32.sh d   (~60 s) the split chunk attention (models/chunk_attention.py):
#        its GPU tests, then its time and error against the masked chunks at 185k and 32k
#   bash bench/gpu_s32.sh p   the prefill part of a alone
#   bash bench/gpu_s32.sh c   (~200 s) the GPU test of a prefill chunk's sync, p, then
#        attention at 1.5 against 2 programs per SM (call 1 of session 32: 1.5 won at every
#        batch 1 point, H100): batch 8 and 128k points of the shape, and the default
#        model's shape at 32k and 185k
# Session 32 ran a, c and the probe; d and b are next (bench/RESULTS.md "Session 32").
source bench/gpu_setup.sh

prefill() {
  timeout 150 python3 -m bench.prefill --shape smollm2-135m --contexts 32768 185000 \
    --chunks 0 8192 2048 --reps 2 --json-out "$OUT/prefill_135m.json" 2>&1 | grep "^ctx"
  timeout 100 python3 -m bench.prefill --shape llama3-8b --contexts 32768 \
    --chunks 0 8192 2048 --reps 2 --json-out "$OUT/prefill_8b.json" 2>&1 | grep -E "^ctx|Error"
}

if [ "$1" = a ]; then
  prefill
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_prefill_attention.py \
    2>&1 | tail -2
  timeout 100 python3 -m bench.kernel_sweep --points 1:8192:1 1:32768:1 1:8192:16 1:32768:16 \
    --configs 64,4,3 32,4,3 --waves 0.5 1 1.5 2 3 4 --time-limit 90 \
    --out "$OUT/sweep_waves.json" 2>&1 | sed -n '/^summary/,$p'
  verify_ab 45 1
elif [ "$1" = p ]; then
  prefill
elif [ "$1" = c ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_prefill_chunks.py \
    2>&1 | tail -2
  prefill
  timeout 100 python3 -m bench.kernel_sweep --points 8:8192:16 8:32768:16 8:131072:16 \
    1:131072:16 8:32768:1 8:131072:1 1:131072:1 --configs 64,4,3 --waves 1.5 2 \
    --time-limit 90 --out "$OUT/sweep_waves_b8.json" 2>&1 | sed -n '/^summary/,$p'
  timeout 60 python3 -m bench.kernel_sweep --shape 9,3,64 --points 1:32768:16 1:185000:16 \
    1:185000:1 --configs 128,4,3 --waves 1.5 2 --time-limit 50 \
    --out "$OUT/sweep_waves_135m.json" 2>&1 | sed -n '/^summary/,$p'
elif [ "$1" = d ]; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_chunk_attention.py \
    2>&1 | tail -3
  timeout 60 python3 -m bench.sdpa_chunk_probe --context 185000 --chunk 8192 2>&1 | tail -9
  timeout 40 python3 -m bench.sdpa_chunk_probe --context 32768 --chunk 8192 --heads 32 \
    --dim 128 2>&1 | tail -9
  SPLITFLASH_PREFILL_SPLIT_ATTENTION=1 timeout 120 python3 -m bench.prefill --shape smollm2-135m \
    --contexts 32768 185000 --chunks 0 8192 2048 --reps 2 2>&1 | grep "^ctx"
elif [ "$1" = b ]; then
  timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
fi
