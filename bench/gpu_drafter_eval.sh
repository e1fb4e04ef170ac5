#!/usr/bin/env bash
# Device call 4 of issue 4, on the machine that ran gpu_drafter_train.sh (/tmp/dr, /tmp/d and
# the model are still there): pooled mean commit_len of the new drafter on held-out prompts
# at block 8 and 16 (offline, derived from the target's greedy output; the old shipped
# drafter beside it), the real step loop on a few prompts as a cross-check, and the draft
# step time at 2k/32k/128k context with the window on and off. Carry: .whl
set -uo pipefail
export SPLITFLASH_CACHE=$HOME/c PYTHONUNBUFFERED=1
python3 -m bench.drafter --offline --drafter /tmp/dr --data /tmp/d --n-prompts 32 \
  --max-tokens 128 --block-sizes 8 16 --device cuda --json-out "$OUT/accept_new.json" 2>&1 \
  | tail -12
python3 -m bench.drafter --offline --data /tmp/d --n-prompts 32 --max-tokens 128 \
  --block-sizes 8 16 --device cuda --json-out "$OUT/accept_shipped.json" 2>&1 | tail -12
timeout 150 python3 -m bench.drafter --drafter /tmp/dr --data /tmp/d --n-prompts 4 \
  --max-tokens 64 --block-sizes 8 --device cuda --json-out "$OUT/accept_steploop.json" 2>&1 \
  | tail -12
python3 -m bench.drafter_step --device cuda --drafter /tmp/dr \
  --json-out "$OUT/draft_step.json" 2>&1 | tail -30
