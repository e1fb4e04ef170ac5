#!/bin/bash
# Session 28 (H100 or H200). carry [".whl"].
#   bash bench/gpu_s28.sh prof   the bf16 GPU tests of the fused linears and graphs, then
#        the verify step's per-kernel profile at 512 and 185k (q 16) on this code
#   bash bench/gpu_s28.sh ab     (`before/`: mkdir before && git archive 4caa56c splitflash
#        bench | tar -x -C before) the GPU tests of attention with RoPE inside and of the
#        graphs; the verify step before / after / after with (64, 4, 3) attention tiles
#        alternated; a profile of both at 185k q 16
#   bash bench/gpu_s28.sh ab2    ab with the RoPE tests only and a profile of this code
#   bash bench/gpu_s28.sh fold   (not run yet; for the H200) the RoPE fold on and off by its
#        switch, alternated three times, after its bf16 tests
#   bash bench/gpu_s28.sh final  the GPU tests of graphs, warm-ups, the drafter and the RoPE
#        attention; the verify step before / after alternated three times
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$1" = prof ]; then
  timeout 240 python3 -m pytest -q -m gpu tests/unit/test_graph_memory.py \
    tests/unit/test_verify_graphs.py tests/unit/test_draft_graphs.py \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_kernels_fused.py 2>&1 | tail -4
  timeout 150 python3 -m bench.verify_step --contexts 512 185000 --q-lens 16 --reps 40 \
    --profile --json-out "$OUT/verify_step_profile_s28.json" 2>&1 | grep -v Warning | tail -60
elif [ "$1" = ab ] || [ "$1" = ab2 ]; then  # ab2: the RoPE tests only, one profile
  tests="tests/unit/test_verify_graphs.py tests/unit/test_kernels_fused_linear.py"
  [ "$1" = ab2 ] && tests=
  timeout 200 python3 -m pytest -q -m gpu tests/unit/test_kernels_paged_rope.py $tests \
    2>&1 | tail -4
  for t in before . c64 before . c64 ; do  # c64: this code, attention tiles (64, 4, 3)
    cfg=; d=$t; [ $t = c64 ] && cfg=64,4,3 && d=.
    (cd $d && SPLITFLASH_KERNEL_CONFIG=$cfg PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m \
      bench.verify_step --contexts 512 185000 --q-lens 16 1 --reps 40 \
      --json-out "$OUT/verify_step_s28_${t/./after}_$SECONDS.json" 2>&1 | grep -E "\] ctx" \
      | sed "s|^|$t |")
  done
  profiled="before ."; [ "$1" = ab2 ] && profiled=.
  for t in $profiled ; do
    name=after; [ $t = before ] && name=before
    (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 90 python3 -m bench.verify_step \
      --contexts 185000 --q-lens 16 --reps 20 --profile \
      --json-out "$OUT/verify_step_profile_s28_$name.json" 2>&1 \
      | grep -v Warning | grep -A32 "profile ctx" | sed "s|^|$t |")
  done
elif [ "$1" = fold ]; then  # the fold alone (SPLITFLASH_ROPE_IN_ATTENTION), any GPU, no before/
  timeout 120 python3 -m pytest -q -m gpu tests/unit/test_kernels_paged_rope.py 2>&1 | tail -2
  for f in 0 1 0 1 0 1 ; do
    SPLITFLASH_ROPE_IN_ATTENTION=$f timeout 50 python3 -m bench.verify_step --contexts 512 \
      185000 --q-lens 16 1 --reps 40 --json-out "$OUT/verify_step_fold${f}_$SECONDS.json" \
      2>&1 | grep -E "\] ctx" | sed "s|^|fold=$f |"
  done
elif [ "$1" = final ]; then  # the GPU tests the changes touch; before / after alternated
  timeout 170 python3 -m pytest -q -m gpu tests/unit/test_kernels_paged_rope.py \
    tests/unit/test_verify_graphs.py tests/unit/test_draft_graphs.py tests/unit/test_warmup.py \
    tests/unit/test_dflash_triton_backend.py 2>&1 | tail -4
  for t in before . before . before . ; do
    name=after; [ $t = before ] && name=before
    (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 50 python3 -m bench.verify_step \
      --contexts 512 185000 --q-lens 16 1 --reps 40 \
      --json-out "$OUT/verify_step_s28_final_${name}_$SECONDS.json" 2>&1 | grep -E "\] ctx" \
      | sed "s|^|$t |")
  done
fi
