#!/bin/bash
# Prepared in session 15 (not yet run): the incident's measurement on the H200, decode tok/s
# of one request at 1.4k / 32k / 185k context, target-only vs DFlash with its window on
# (checkpoint) and off (the incident's failure mode), every output checked lossless.
# The default model is 98 MB, a call carries 64 MiB: split it first (host side),
#   ../shared/tools/device-model.sh ~/.cache/splitflash/.../SmolLM2-135M-Instruct.Q4_1.gguf
# then two device calls back to back:
#   1. carry [".model/a"], command: mkdir -p $HOME/m && cp .model/a/* $HOME/m/
#   2. carry [".model/b", ".whl"], command: bash bench/gpu_s16b.sh
cp .model/b/* "$HOME/m/" && cat "$HOME"/m/part-* > "$HOME/m/model.gguf" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 500 python3 -m bench.long_context --device cuda --target "$HOME/m/model.gguf" \
  --contexts 1400 32768 185000 --windows checkpoint off --max-tokens 128 \
  --json-out "$OUT/long_context_h200.json" 2>&1 | grep -v Warn | tail -12
