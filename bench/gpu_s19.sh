#!/bin/bash
# Session 19, carry [".whl"], one call per round:
#   bash bench/gpu_s19.sh sweep   the batch-invariant linears' 64-row tile configs at M 16 and
#                                 128 (bench.linear_sweep --invariant), the launch-chain floor
#                                 (bench.launch_floor), the GPU tests of both
#   bash bench/gpu_s19.sh step    GPU tests, the fast 16-row tiles' sweep at M 16 (to set
#                                 beside the 64-row one), the verify step fast /
#                                 batch-invariant alternated twice, batch 1 and 8
#   (call 3 measured invariant row tiles of 64 / 16 / 16-up-to-M-16 with a temporary toggle:
#    commit 3d4dcee, `bash bench/gpu_s19.sh tiles`)
#   bash bench/gpu_s19.sh final 1 the shipped tiles (16 rows up to M 16, else 64): GPU tests,
#                                 fast / batch-invariant once, batch 1 and 8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
tests() {
  timeout "$1" python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_batch_invariant.py \
    tests/unit/test_kernels_paged_invariant.py 2>&1 \
    | grep -E "fast kernels|passed|failed|Error|assert" | tail -12
}
if [ "$1" = sweep ]; then
  timeout 40 python3 -m bench.launch_floor --json-out "$OUT/launch_floor_h200.json" 2>&1 \
    | grep -v Warn
  timeout 300 python3 -m bench.linear_sweep --invariant --rows 16 128 \
    --json-out "$OUT/linear_sweep_invariant_h200.json" 2>&1 | grep -v Warn
  tests 200
  exit 0
fi
if [ "$1" = step ] || [ "$1" = final ]; then
  tests 200
  [ "$1" = step ] && timeout 120 python3 -m bench.linear_sweep --rows 16 \
    --json-out "$OUT/linear_sweep_fast_s19_h200.json" 2>&1 | grep -v Warn
  tag=$([ "$1" = final ] && echo _final)
  for i in $(seq 1 "${2:-2}"); do
    for inv in "" --batch-invariant; do
      timeout 100 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 16 1 \
        --reps 50 $inv --json-out "$OUT/verify_step_s19$tag${inv:+_invariant}_b1_${i}_h200.json" 2>&1 \
        | grep -E "^ +(512|32768|185000) " | sed "s/^/${inv:-fast} /"
      timeout 100 python3 -m bench.verify_step --contexts 32768 131072 --batches 8 \
        --q-lens 16 --reps 30 $inv \
        --json-out "$OUT/verify_step_s19$tag${inv:+_invariant}_b8_${i}_h200.json" 2>&1 \
        | grep -E "^ +(32768|131072) " | sed "s/^/${inv:-fast} /"
    done
  done
  exit 0
fi
echo "usage: bash bench/gpu_s19.sh sweep|step|final 1" >&2
exit 2
