#!/bin/bash
# Session 15, device call A: GPU tests, then greedy argmax inside the verify graph (75cdfc3)
# against its parent tree 78a9205 unpacked in before/, alternated (bench/RESULTS.md).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_verify_graphs.py \
  tests/unit/test_step_inputs.py 2>&1 | tail -4
run() {
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m bench.verify_step --contexts $3 \
    --batches $4 --q-lens 16 --reps 100 --json-out "$OUT/vs_$2.json" 2>&1 | grep -v Warn | tail -8)
}
for i in 1 2; do
  run before "before_short$i" 512 "1 8 32"
  run . "after_short$i" 512 "1 8 32"
done
for i in 1 2; do
  run before "before_long$i" 185000 "1 8"
  run . "after_long$i" 185000 "1 8"
done
