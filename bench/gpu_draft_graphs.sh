#!/usr/bin/env bash
# Device call for issue 5's draft-step CUDA graphs (carry: .whl): the GPU tests of the pool
# and graphs (captured replay == eager), the draft-step bench (per-request eager vs pooled
# vs graph), then the verify step again (causal bits now built once per forward).
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "== gpu tests"; date +%T
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_draft_graphs.py \
  tests/unit/test_dflash_triton_backend.py tests/unit/test_verify_graphs.py 2>&1 | tail -6
echo "== draft graphs"; date +%T
timeout 150 python3 -m bench.draft_graphs --contexts 2048 32768 131072 --batches 1 8 \
  --json-out "$OUT/draft_graphs.json"
echo "== verify_step"; date +%T
timeout 90 python3 -m bench.verify_step --contexts 512 185000 --q-lens 16 --reps 30 \
  --json-out "$OUT/verify_step.json" 2>&1 | tail -3
date +%T
