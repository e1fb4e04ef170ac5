#!/usr/bin/env bash
# Device call for issue 5's draft-step CUDA graphs and the per-request split length (carry:
# .whl), most important first: the GPU tests of the attention kernels and of the captured
# draft / verify graphs, the 185k verify step (eager vs graph), the draft-step bench at 128k
# (per-request eager vs pooled vs graph).
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "== gpu tests"; date +%T
timeout 110 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit/test_draft_graphs.py \
  tests/unit/test_kernels_paged.py tests/unit/test_verify_graphs.py 2>&1 | tail -8
echo "== verify_step"; date +%T
timeout 40 python3 -m bench.verify_step --contexts 185000 --q-lens 16 --reps 20 \
  --json-out "$OUT/verify_step.json" 2>&1 | tail -2
echo "== draft graphs"; date +%T
timeout 40 python3 -m bench.draft_graphs --contexts 131072 --batches 1 8 --reps 20 \
  --json-out "$OUT/draft_graphs.json"
date +%T
