#!/bin/bash
# Session 25 (no GPU was lent that session: these are queued for the next one).
#   carry [".whl"]: bash bench/gpu_s25.sh a
#     the first steps after the start-up warm-up when verify's feature layers arrive later
#     (a DFlash drafter's Hello), with the idle warm-up run for them; memory held per graph
#     by padded batch and block length (bench.graph_memory: sizes GRAPH_MAX_HELD); the GPU
#     tests of warm-ups and graphs
#   carry [".whl"]: bash bench/gpu_s25.sh f
#     session 24's mode f: engine.verify steps whose requests draft different lengths,
#     padded onto one graph, against the unpadded eager step they ran as before
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$1" = a ]; then
  timeout 200 python3 -m bench.first_step --warmup --late-layers \
    --json-out "$OUT/first_step_late_layers.json" 2>&1 | grep -vE "Warning|capture_end" | tail -24
  timeout 120 python3 -m bench.graph_memory --json-out "$OUT/graph_memory.json" 2>&1 | tail -14
  timeout 240 python3 -m pytest -q -m gpu tests/unit/test_warmup.py \
    tests/unit/test_verify_graphs.py 2>&1 | tail -4
elif [ "$1" = f ]; then
  timeout 300 python3 -m bench.verify_step --contexts 512 32768 --batches 4 8 --q-lens 16 \
    --reps 20 --mixed-drafts --json-out "$OUT/verify_step_mixed.json" 2>&1 | tail -6
fi
