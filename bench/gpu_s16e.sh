#!/bin/bash
# Session 16, device call 3 of 3, right after bench/gpu_s16d.sh. Carry [".whl", ".model/c"].
# The incident's measurement: decode tok/s of one request at 1.4k / 32k / 185k context,
# target-only vs DFlash with its window (checkpoint) and off, every output checked lossless.
cp .model/c/* "$HOME/m/" && cat "$HOME"/m/part-* > "$HOME/m/model.gguf" || exit 1
sha256sum "$HOME/m/model.gguf"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 560 python3 -m bench.long_context --device cuda --target "$HOME/m/model.gguf" \
  --contexts 1400 32768 185000 --windows checkpoint off --max-tokens 128 \
  --json-out "$OUT/long_context_h200.json" 2>&1 | grep -v Warn | tail -12
