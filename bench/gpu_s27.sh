#!/bin/bash
# Session 27 (H100). carry [".whl"]. `before/`: mkdir before && git archive a6044d3
#   splitflash bench tests pyproject.toml | tar -x -C before && cp tests/unit/test_graph_memory.py
#   before/tests/unit/ && rm -rf before/bench/results before/splitflash/assets
#   bash bench/gpu_s27.sh min    the graph-memory tests here and in before/ (ran, session 27)
#   bash bench/gpu_s27.sh short  ship without the warm-up tests, one before/after pass, f
#   bash bench/gpu_s27.sh ship   (`before/` = a6044d3's splitflash, bench and tests, plus
#        tests/unit/test_graph_memory.py) the GPU tests of graphs and fused linears; the
#        graph-memory test against before/ (where it must fail); bench.graph_memory before vs
#        after one side stream per graph set; the verify step before vs after the shipped
#        norm (whole rows loaded before the K loop, reduced after it), alternated; then
#        gpu_s25.sh f
#   bash bench/gpu_s27.sh norm8b (ran; needs `git show a6044d3:bench/patches/norm_stats_modes.patch
#        | git apply`)   the norm-statistics modes 0 and 2 alternated on the verify
#        step at Llama-3-8B's shape (K 4096: mode 2 holds a whole row across the K loop) and on
#        the default model's q 1 step
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
memory_before_after() {  # the graph-memory test in before/ (it must fail), graph_memory both
  (cd before && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m pytest -q -m gpu \
    tests/unit/test_graph_memory.py 2>&1 | grep -E "^E .*assert|passed|failed" | tail -6)
  for t in before . ; do
    echo "== graph_memory $t"; (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m \
      bench.graph_memory --batches 1 8 --q-lens 16 --contexts 512 3000 20000 2>&1 | grep -E "B +[0-9]")
  done
}
if [ "$1" = norm8b ]; then
  for m in 0 2 0 2; do
    echo "== mode $m"
    SPLITFLASH_NORM_MODE=$m timeout 130 python3 -m bench.verify_step --shape llama3-8b \
      --contexts 512 185000 --q-lens 16 --reps 20 \
      --json-out "$OUT/vs8b_norm${m}_$SECONDS.json" 2>&1 | grep -E "\] ctx"
  done
  for m in 0 2 0 2; do
    SPLITFLASH_NORM_MODE=$m timeout 60 python3 -m bench.verify_step --contexts 512 185000 \
      --q-lens 1 --reps 40 2>&1 | grep -E "\] ctx" | sed "s/^/m$m /"
  done
elif [ "$1" = ship ] || [ "$1" = short ]; then  # short: without the warm-up tests, 2 runs, f
  [ "$1" = ship ] && warm=tests/unit/test_warmup.py
  timeout 240 python3 -m pytest -q -m gpu tests/unit/test_graph_memory.py $warm \
    tests/unit/test_verify_graphs.py tests/unit/test_draft_graphs.py \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_kernels_fused.py 2>&1 | tail -4
  memory_before_after
  runs="before . before ."; [ "$1" = short ] && runs="before ."
  for t in $runs; do
    (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m bench.verify_step \
      --contexts 512 185000 --q-lens 16 1 --reps 40 2>&1 | grep -E "\] ctx" | sed "s|^|$t |")
  done
  [ "$1" = ship ] && timeout 200 python3 -m bench.verify_step --contexts 512 32768 \
    --batches 4 8 --q-lens 16 --reps 20 --mixed-drafts --json-out "$OUT/verify_step_mixed.json" 2>&1 | tail -6
elif [ "$1" = min ]; then  # the graph-memory test here and in before/, graph_memory both
  timeout 100 python3 -m pytest -q -m gpu tests/unit/test_graph_memory.py 2>&1 | tail -3
  memory_before_after
fi
