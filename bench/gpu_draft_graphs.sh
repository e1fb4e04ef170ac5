#!/usr/bin/env bash
# Device call for issue 5's draft-step CUDA graphs and the per-request split length (carry:
# .whl): the verify step (eager vs graph at 512 / 185k), the draft-step bench (per-request
# eager vs pooled vs graph), then the GPU tests of the kernels and graphs.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "== verify_step"; date +%T
timeout 90 python3 -m bench.verify_step --contexts 512 185000 --q-lens 16 --reps 30 \
  --json-out "$OUT/verify_step.json" 2>&1 | tail -3
echo "== draft graphs"; date +%T
timeout 100 python3 -m bench.draft_graphs --contexts 2048 32768 131072 --batches 1 8 \
  --json-out "$OUT/draft_graphs.json"
echo "== gpu tests"; date +%T
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_draft_graphs.py \
  tests/unit/test_verify_graphs.py tests/unit/test_kernels_paged.py tests/unit/test_kernels_draft.py \
  tests/unit/test_dflash_triton_backend.py 2>&1 | tail -12
date +%T
