#!/bin/bash
# For the next device call (H100 or H200). carry [".whl"].
#   bash bench/gpu_s33.sh a   (~400 s) the kernel bench with L2 cold (input copies
#        rotated past L2, bench.kernels's new default), then its batch 1 points at 8k / 32k
#        warm (one copy, as every earlier session timed them) beside cold; the prefill of the
#        default model's shape with the split chunk attention on (auto) and off (0) side by
#        side; the GPU tests of prefill and chunk attention at this commit
#   bash bench/gpu_s33.sh b   every GPU test (~150 s on an H100)
#   bash bench/gpu_s33.sh w   (~330 s) waves 1.5 for heads wider than 64 dims (kv_splits) against
#        the rules before it, side by side: the kernel bench (L2 cold) and the verify
#        step of Llama-3-8B's shape at 32k and 185k; then the paged kernels' GPU tests
source bench/gpu_setup.sh

if [ "$1" = a ]; then
  timeout 200 python3 -m bench.kernels --l2 cold --out "$OUT/kernels_cold.json" 2>&1 | tail -30
  timeout 60 python3 -m bench.kernels --l2 warm --batch-sizes 1 --kv-lens 8192,32768 \
    --q-lens 1,16 --out "$OUT/kernels_warm_b1.json" 2>&1 | tail -8
  for mode in "" 0; do
    SPLITFLASH_PREFILL_SPLIT_ATTENTION=$mode timeout 60 python3 -m bench.prefill \
      --shape smollm2-135m --contexts 185000 --chunks 0 8192 --reps 2 \
      --json-out "$OUT/prefill_split${mode:-auto}.json" 2>&1 | grep "^ctx" | sed "s|^|split=${mode:-auto} |"
  done
  timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_chunk_attention.py \
    tests/unit/test_prefill_chunks.py tests/unit/test_prefill_attention.py 2>&1 | tail -2
elif [ "$1" = w ]; then
  old="import splitflash.kernels.kv_splits as k; k.WAVES_WIDE_HEADS.clear()"
  for rule in new old; do
    pre=""; [ $rule = old ] && pre="$old;"
    timeout 150 python3 -c "$pre
from bench.kernels import main; main(['--q-lens', '1,16', '--out', '$OUT/kernels_waves_$rule.json'])" 2>&1 \
      | grep -E "^│" | sed "s|^|$rule |"
  done
  for rule in new old; do
    pre=""; [ $rule = old ] && pre="$old;"
    timeout 120 python3 -c "$pre
from bench.verify_step import main; main(['--shape', 'llama3-8b', '--contexts', '32768', '185000',
  '--reps', '20', '--json-out', '$OUT/verify_8b_waves_$rule.json'])" 2>&1 | grep -E "\] ctx" \
      | sed "s|^|$rule |"
  done
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_kernels_paged.py \
    tests/unit/test_kernels_paged_paths.py 2>&1 | tail -2
elif [ "$1" = b ]; then
  timeout 290 python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tail -4
fi
