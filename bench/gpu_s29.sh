#!/bin/bash
# Session 29 (H200 or H100). carry [".whl"].
#   bash bench/gpu_s29.sh split   the GPU tests of split-K linears (kernels/split_k.py) and of
#        the graphs; the four linears of a layer at each split cap, weights from HBM; the
#        verify step with split-K off (SPLITFLASH_LINEAR_SPLIT_K=1, the code before it) and
#        auto, alternated once
#   bash bench/gpu_s29.sh ab      off / auto alternated three times; a profile of each at
#        185k q 16
#   bash bench/gpu_s29.sh all     split's and draft's GPU tests, split-K off / auto and the
#        drafter's modules / fused once each, then the linears' split sweep (one call)
#   bash bench/gpu_s29.sh ab2     (not run yet; split-K now off by default, `auto` splits K >=
#        1024 only) the split-K GPU tests; the verify step off / auto / off / auto; the
#        drafter (fused, split-K off: the shipped code) once; the linears' cold split sweep
#   bash bench/gpu_s29.sh draft   the GPU tests of the fused drafter (models/dflash/fused.py)
#        and of the draft graphs; bench.draft_graphs with the modules (SPLITFLASH_FUSED_DRAFTER=0)
#        and fused, alternated twice
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$1" = all ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/unit/test_kernels_split_k.py \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_verify_graphs.py \
    tests/unit/test_dflash_fused.py tests/unit/test_draft_graphs.py \
    tests/unit/test_draft_graph_appends.py tests/unit/test_dflash_triton_backend.py 2>&1 | tail -4
  for s in 1 auto ; do
    SPLITFLASH_LINEAR_SPLIT_K=$s timeout 50 python3 -m bench.verify_step --contexts 512 \
      185000 --q-lens 16 1 --reps 40 --json-out "$OUT/verify_step_split${s}_$SECONDS.json" \
      2>&1 | grep -E "\] ctx" | sed "s|^|split=$s |"
  done
  for f in 0 1 ; do
    SPLITFLASH_FUSED_DRAFTER=$f timeout 60 python3 -m bench.draft_graphs --contexts 2048 131072 \
      --batches 1 8 --reps 20 --json-out "$OUT/draft_graphs_fused${f}_$SECONDS.json" 2>&1 \
      | grep -v Warning | tail -5 | sed "s|^|fused=$f |"
  done
  timeout 120 python3 -m bench.linear_sweep --splits 1 2 3 6 0 --cold --rows 16 \
    --reps 15 --json-out "$OUT/linear_split_s29.json" 2>&1 | grep "^M "
fi
if [ "$1" = split ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/unit/test_kernels_split_k.py \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_verify_graphs.py 2>&1 | tail -4
  timeout 150 python3 -m bench.linear_sweep --splits 1 2 3 4 6 0 --cold --rows 1 16 32 \
    --reps 15 --json-out "$OUT/linear_split_s29.json" 2>&1 | grep "^M "
fi
if [ "$1" = split ] || [ "$1" = ab ]; then
  runs="1 auto"; [ "$1" = ab ] && runs="1 auto 1 auto 1 auto"
  for s in $runs ; do
    SPLITFLASH_LINEAR_SPLIT_K=$s timeout 50 python3 -m bench.verify_step --contexts 512 \
      185000 --q-lens 16 1 --reps 40 --json-out "$OUT/verify_step_split${s}_$SECONDS.json" \
      2>&1 | grep -E "\] ctx" | sed "s|^|split=$s |"
  done
fi
if [ "$1" = ab ]; then
  for s in 1 auto ; do
    SPLITFLASH_LINEAR_SPLIT_K=$s timeout 60 python3 -m bench.verify_step --contexts 185000 \
      --q-lens 16 --reps 20 --profile --json-out "$OUT/verify_step_profile_split$s.json" \
      2>&1 | grep -v Warning | grep -A14 "profile ctx" | sed "s|^|split=$s |"
  done
fi
if [ "$1" = draft ]; then
  timeout 200 python3 -m pytest -q -m gpu tests/unit/test_dflash_fused.py \
    tests/unit/test_draft_graphs.py tests/unit/test_draft_graph_appends.py \
    tests/unit/test_dflash_triton_backend.py 2>&1 | tail -4
  for f in 0 1 0 1 ; do
    SPLITFLASH_FUSED_DRAFTER=$f timeout 60 python3 -m bench.draft_graphs --contexts 2048 131072 \
      --batches 1 8 --reps 20 --json-out "$OUT/draft_graphs_fused${f}_$SECONDS.json" 2>&1 \
      | grep -v Warning | tail -5 | sed "s|^|fused=$f |"
  done
fi
if [ "$1" = ab2 ]; then
  timeout 100 python3 -m pytest -q -m gpu tests/unit/test_kernels_split_k.py 2>&1 | tail -2
  for s in 1 auto 1 auto ; do
    SPLITFLASH_LINEAR_SPLIT_K=$s timeout 30 python3 -m bench.verify_step --contexts 512 \
      185000 --q-lens 16 1 --reps 40 --json-out "$OUT/verify_step_split${s}_$SECONDS.json" \
      2>&1 | grep -E "\] ctx" | sed "s|^|split=$s |"
  done
  timeout 50 python3 -m bench.draft_graphs --contexts 2048 131072 --batches 1 8 --reps 20 \
    --json-out "$OUT/draft_graphs_shipped.json" 2>&1 | grep -v Warning | tail -4
  timeout 60 python3 -m bench.linear_sweep --splits 1 3 6 0 --cold --rows 16 \
    --reps 15 --json-out "$OUT/linear_split_s29.json" 2>&1 | grep "^M "
fi
