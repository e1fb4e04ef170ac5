#!/bin/bash
# Session 29 (H200 or H100). carry [".whl"].
#   bash bench/gpu_s29.sh all   (call 1, H100) the GPU tests of split-K and of the fused
#        drafter; the verify step with split-K off / splitting every launch of fewer tiles
#        than SMs (the first rule); the drafter as modules / fused; the linears' cold split
#        sweep
#   (its second mode, never run, became bench/gpu_s30.sh a)
source bench/gpu_setup.sh

if [ "$1" = all ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/unit/test_kernels_split_k.py \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_verify_graphs.py \
    tests/unit/test_dflash_fused.py tests/unit/test_draft_graphs.py \
    tests/unit/test_draft_graph_appends.py tests/unit/test_dflash_triton_backend.py 2>&1 | tail -4
  verify_ab 50 1 auto
  for f in 0 1 ; do
    SPLITFLASH_FUSED_DRAFTER=$f timeout 60 python3 -m bench.draft_graphs --contexts 2048 131072 \
      --batches 1 8 --reps 20 --json-out "$OUT/draft_graphs_fused${f}_$SECONDS.json" 2>&1 \
      | grep -v Warning | tail -5 | sed "s|^|fused=$f |"
  done
  timeout 120 python3 -m bench.linear_sweep --splits 1 2 3 6 0 --cold --rows 16 \
    --reps 15 --json-out "$OUT/linear_split_s29.json" 2>&1 | grep "^M "
fi
