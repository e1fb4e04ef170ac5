#!/bin/bash
# Session 31 (H100 or H200), call 2. carry [".whl", "before"] (before/: see gpu_s30.sh).
#   the draft call's host work before / after at an 8-token vocab (bench/draft_host.py);
#   the attention of the default model's shape (H 9, H_KV 3, D 64) at 185k keys, batch 1,
#   q 16 and 1, over the narrow-head configs and waves; batch 1 x 8k / 32k at q 1 (the
#   issue's shape) over configs at the default split rule; the verify step at 512 and 185k
source bench/gpu_setup.sh

for i in 1 2; do
  [ -d before ] && (cd before && PYTHONPATH=$PWD:/tmp/site timeout 20 python3 -m \
    bench.draft_host --batches 1 8 32 --reps 100 2>&1 | tail -3 | sed "s|^|before |")
  timeout 20 python3 -m bench.draft_host --batches 1 8 32 --reps 100 2>&1 | tail -3 \
    | sed "s|^|after  |"
done
timeout 150 python3 -m bench.kernel_sweep --shape 9,3,64 --points 1:185000:16 1:185000:1 \
  8:32768:16 --configs 128,4,3 128,4,4 64,4,3 64,4,4 32,4,3 128,8,3 --time-limit 140 \
  --out "$OUT/sweep_smollm2.json" 2>&1 | sed -n '/^summary/,$p'
timeout 90 python3 -m bench.kernel_sweep --points 1:8192:1 1:32768:1 --configs 64,4,3 \
  32,4,3 64,4,2 32,4,2 64,8,3 --time-limit 80 --out "$OUT/sweep_q1.json" 2>&1 \
  | sed -n '/^summary/,$p'
verify_ab 45 1
