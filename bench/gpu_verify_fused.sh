#!/usr/bin/env bash
# Device call for issue 5 after the linear sweep (carry: .whl), every step logged to
# $OUT/log.txt: the bf16 GPU tests of the fused kernels and captured verify graphs, then the
# verify step of the default model's shape at 512 / 185k side by side: the default (fused
# linears + PDL, attention without PDL), fused without PDL, and the unfused path (cuBLAS
# GEMMs, separate norm / SwiGLU / residual add, no PDL).
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "== gpu tests"; date +%T
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_kernels_fused_linear.py \
  tests/unit/test_verify_graphs.py tests/unit/test_kernels_fused.py 2>&1 | tail -6
for variant in "default 1 1" "fused_nopdl 1 0" "unfused 0 0"; do
  set -- $variant
  echo "== verify_step $1"; date +%T
  SPLITFLASH_FUSED_LINEAR=$2 SPLITFLASH_PDL=$3 timeout 70 python3 -m bench.verify_step \
    --contexts 512 185000 --q-lens 16 --reps 40 --profile --json-out "$OUT/verify_step_$1.json" \
    2>&1 | grep -v "^    .*us .*x  " | tail -3
done
date +%T
