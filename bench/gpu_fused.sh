#!/usr/bin/env bash
# Device call for issue 5's fused small-M linears + programmatic dependent launch (carry: .whl),
# most important first, every step logged to $OUT/log.txt:
#   1. the bf16 GPU tests (every kernel vs its reference, captured graphs == eager);
#   2. the verify step of the default model's shape at 512 / 185k, side by side: fused + PDL
#      (the default), fused without PDL, and neither (cuBLAS GEMMs, separate norm / SwiGLU);
#   3. the draft-step graphs at 128k (their GPU test was fixed after the last device run).
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "== gpu tests"; date +%T
timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit -x 2>&1 | tail -15
for variant in "fused_pdl 1 1" "fused 1 0" "unfused 0 0"; do
  set -- $variant
  echo "== verify_step $1"; date +%T
  SPLITFLASH_FUSED_LINEAR=$2 SPLITFLASH_PDL=$3 timeout 110 python3 -m bench.verify_step \
    --contexts 512 185000 --q-lens 16 --reps 30 --profile --json-out "$OUT/verify_step_$1.json" \
    2>&1 | grep -v "^    .*us .*x  " | tail -8
done
echo "== draft graphs"; date +%T
timeout 40 python3 -m bench.draft_graphs --contexts 131072 --batches 1 8 --reps 20 \
  --json-out "$OUT/draft_graphs.json" 2>&1 | tail -6
date +%T
