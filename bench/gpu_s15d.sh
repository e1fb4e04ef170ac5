#!/bin/bash
# Session 15, device call D: GPU tests of the committed code (attention triggering its
# combine, features copied to pinned memory), then the verify step as committed.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_kernels_paged.py \
  tests/unit/test_kernels_paged_paths.py tests/unit/test_verify_graphs.py \
  tests/unit/test_feature_batches.py 2>&1 | tail -4
timeout 150 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 16 1 --reps 100 \
  --json-out "$OUT/verify_step_trigger_h200.json" 2>&1 | grep -E "^ +(context|512|32768|185000) "
