#!/usr/bin/env bash
# Device call 3 of issue 4. A call carries at most 64 MiB with the tree, so the 98 MB GGUF
# travels in thirds (.model/a, .model/b, .model/c; `split -n 3`): calls 1 and 2 only copy
# their third to $HOME/m, back to back. This call rebuilds the default model, lets the
# target regenerate the training responses, trains the
# DFlash drafter and hand the checkpoint back under $OUT (split: files come back <= 16 MiB).
# Carry: .model/c .whl .traindata (prompts built on the dev machine, see COMMAND.md).
set -euo pipefail
export SPLITFLASH_CACHE=$HOME/c PYTHONUNBUFFERED=1
gguf=$SPLITFLASH_CACHE/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$(dirname "$gguf")" /tmp/d
cp .model/c/* "$HOME/m/" && cat "$HOME"/m/part-* > "$gguf"
sha256sum "$gguf"
gunzip -c .traindata/prompts.jsonl.gz > /tmp/d/prompts.jsonl
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
python3 -m splitflash.cli.train_cmd --out /tmp/dr --data /tmp/d --prompts 9224 \
  --gen-batch 1024 --gen-budget "${GEN_BUDGET:-150}" --steps 8000 \
  --time-budget "${TRAIN_BUDGET:-330}" --device cuda 2>&1 | tee "$OUT/train.log" | grep -v '━'
split -b 10M /tmp/dr/model.safetensors "$OUT/ckpt.part-"
cp /tmp/dr/config.json /tmp/dr/training_summary.json "$OUT/"
sha256sum /tmp/dr/model.safetensors
