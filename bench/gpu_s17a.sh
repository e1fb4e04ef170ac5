#!/bin/bash
# Prepared in session 16 for the next session (not yet run). Device call 1, carry [".whl"]:
# 1. GPU tests of the draft graphs that now write the step's context rows themselves
#    (2f449ac: captured appends vs the eager proposer), the prefill memory test, verify graphs.
# 2. The draft step graph at 2k / 128k, batch 1 / 8: its replay now includes context_kv over
#    N_pad x 16 rows and the pool writes (session 15's replay: 0.432-0.681 ms, RESULTS.md).
# Then the long_context measurement again, the model in thirds (bench/gpu_s16f.sh a, b, c):
# the DFlash propose was ~2.0-2.2 ms, ~1.2 ms of it the eager append.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_draft_graphs.py \
  tests/unit/test_draft_graph_appends.py tests/unit/test_prefill_attention.py \
  tests/unit/test_verify_graphs.py 2>&1 | tail -3
timeout 120 python3 -m bench.draft_graphs --contexts 2048 131072 --batches 1 8 --reps 50 \
  --json-out "$OUT/draft_graphs_appends.json" 2>&1 | grep -v Warn | tail -6
