#!/usr/bin/env bash
# Device call (carry: .whl) for the KV L2 prefetch (kernels/kv_prefetch.py): the verify step of
# the default model's shape at 185k against keys prefetched per split (0 = off), side by side
# in one process; then 32k; the GPU tests (prefetch on == off bit for bit, graphs, fused
# linears); then a per-kernel profile with the prefetch off and on.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
step() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  echo "== verify_step $name"; date +%T
  timeout "$limit" python3 -m bench.verify_step --q-lens 16 "$@" \
    --json-out "$OUT/verify_step_$name.json" 2>&1 | grep -v "^    .*us .*x  "
}
step prefetch_185k 240 --contexts 185000 --reps 30 --prefetch-keys 0 256 512 1024 2048
step prefetch_32k 120 --contexts 512 32768 --reps 30 --prefetch-keys 0 512
echo "== gpu tests"; date +%T
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_kv_prefetch.py \
  tests/unit/test_verify_graphs.py tests/unit/test_kernels_fused_linear.py 2>&1 | tail -4
echo "== profile"; date +%T
timeout 120 python3 -m bench.verify_step --q-lens 16 --contexts 185000 --reps 10 \
  --prefetch-keys 0 1024 --profile --json-out "$OUT/verify_step_prefetch_profile.json" 2>&1 \
  | grep -E "ctx|kernels per step|attn|kv_prefetch|combine" | head -20
date +%T
