#!/bin/bash
# Session 20, carry [".whl"] (ab: [".whl", "before"]), one call per round:
#   bash bench/gpu_s20.sh probe   where a 185k attention launch's time goes (bench.attn_floor),
#                                 the launch floor again (bench.launch_floor, refactored in
#                                 s19), 16- vs 64-row tiles of the fast linears at M 32-256
#                                 (bench.linear_sweep --compare), the fused-linear GPU tests
#   bash bench/gpu_s20.sh prefetch  at commit 3728bf1 (its attention prefetch since reverted):
#                                 bench.attn_floor with the attention's L2 look-ahead
#                                 (PREFETCHES tiles), the GPU tests of the paged attention
#                                 and the fused linears (64-row fast tiles above M 32)
#   bash bench/gpu_s20.sh ab      the fast verify step at batch 2 / 4 / 8 / 16, before/
#                                 (splitflash + bench of commit 927676f: 16-row tiles up to
#                                 M 64, then cuBLAS) against this tree (64-row tiles above
#                                 M 32, fused up to M 256), alternated twice
#   bash bench/gpu_s20.sh final   bench.attn_floor with more attention tile configs (BLOCK_N
#                                 128, deeper pipelines); the verify step fast and
#                                 batch-invariant, batch 1 and 8, once each
#   bash bench/gpu_s20.sh ab2     before/ = commit d0b48cd (splitflash + bench; the shipped attention
#                                 configs) against this tree (128-key tiles at D <= 64),
#                                 verify step batch 1 and 8, alternated twice; GPU tests of
#                                 the paged attention
# before/ made with: git worktree add /tmp/b 927676f; mkdir before; cp -r /tmp/b/{splitflash,bench} before/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
if [ "$1" = probe ]; then
  timeout 150 python3 -m bench.attn_floor --json-out "$OUT/attn_floor_h200.json" 2>&1 | grep -v Warn
  timeout 40 python3 -m bench.launch_floor --json-out "$OUT/launch_floor_s20_h200.json" 2>&1 \
    | grep -v Warn
  timeout 200 python3 -m bench.linear_sweep --compare --rows 32 64 128 256 \
    --json-out "$OUT/linear_compare_h200.json" 2>&1 | grep -v Warn
  timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_batch_invariant.py 2>&1 \
    | grep -E "passed|failed|Error|assert" | tail -12
  exit 0
fi
if [ "$1" = prefetch ]; then
  timeout 200 python3 -m bench.attn_floor --json-out "$OUT/attn_floor_prefetch_h200.json" 2>&1 \
    | grep -v -i warn
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_kernels_paged.py \
    tests/unit/test_kernels_paged_paths.py tests/unit/test_kernels_fused_linear.py 2>&1 \
    | grep -E "passed|failed|Error|assert" | tail -12
  exit 0
fi
if [ "$1" = final ]; then
  timeout 200 python3 -m bench.attn_floor --configs 128,4,3 128,4,2 128,8,3 64,4,5 64,4,6 \
    64,8,4 --json-out "$OUT/attn_floor_configs_h200.json" 2>&1 | grep -E "^(attention|paged|flat|185)"
  for inv in "" --batch-invariant; do
    timeout 100 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 16 1 \
      --reps 50 $inv --json-out "$OUT/verify_step_s20${inv:+_invariant}_b1_h200.json" 2>&1 \
      | grep -E "^ +(512|32768|185000) " | sed "s/^/${inv:-fast} /"
    timeout 100 python3 -m bench.verify_step --contexts 32768 131072 --batches 8 \
      --q-lens 16 --reps 30 $inv \
      --json-out "$OUT/verify_step_s20${inv:+_invariant}_b8_h200.json" 2>&1 \
      | grep -E "^ +(32768|131072) " | sed "s/^/${inv:-fast} /"
  done
  exit 0
fi
if [ "$1" = ab2 ]; then
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_kernels_paged.py \
    tests/unit/test_kernels_paged_paths.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
  run() {
    (cd "$1" && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m bench.verify_step \
      --contexts 512 32768 185000 --q-lens 16 1 --reps 50 \
      --json-out "$OUT/verify_step_s20_$2_b1_h200.json" 2>&1 \
      | grep -E "^ +(512|32768|185000) " | sed "s/^/$2 /"
     PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m bench.verify_step --contexts 32768 \
      --batches 8 --q-lens 16 --reps 30 --json-out "$OUT/verify_step_s20_$2_b8_h200.json" \
      2>&1 | grep -E "^ +32768 " | sed "s/^/$2 /")
  }
  run before n64_1; run . n128_1; run before n64_2; run . n128_2
  exit 0
fi
if [ "$1" = ab ]; then
  run() {
    (cd "$1" && PYTHONPATH=$PWD:/tmp/site timeout 130 python3 -m bench.verify_step \
      --contexts 512 32768 --batches 2 4 8 16 --q-lens 16 --reps 30 \
      --json-out "$OUT/verify_step_s20_$2_h200.json" 2>&1 \
      | grep -E "^ +(512|32768) " | sed "s/^/$2 /")
  }
  run before before1; run . after1; run before before2; run . after2
  exit 0
fi
echo "usage: bash bench/gpu_s20.sh probe|prefetch|ab|final|ab2" >&2
exit 2
