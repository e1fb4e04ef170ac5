#!/usr/bin/env bash
# Short device call (carry: .whl) after folding the RMSNorm weight into the qkv / gate_up
# weights: the verify step at 512 / 185k with the default path (profiled), the bf16 GPU test
# of the fused linears, then the unfused path (cuBLAS, no PDL) for the side-by-side ratio.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
run_step() {  # name fused pdl [extra args]
  echo "== verify_step $1"; date +%T
  SPLITFLASH_FUSED_LINEAR=$2 SPLITFLASH_PDL=$3 timeout 50 python3 -m bench.verify_step \
    --contexts 512 185000 --q-lens 16 --reps 30 ${4:-} --json-out "$OUT/verify_step_$1.json" \
    2>&1 | grep -v "^    .*us .*x  " | tail -3
}
run_step folded 1 1 --profile
echo "== gpu test"; date +%T
timeout 40 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_kernels_fused_linear.py \
  2>&1 | tail -3
run_step unfused 0 0
date +%T
