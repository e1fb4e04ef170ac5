#!/bin/bash
# Session 15, device call C: attention triggering its combine's launch early
# (SPLITFLASH_ATTN_TRIGGER=1) against off, alternated, in the verify step.
# Ran on the working tree of fe07892 with temporary env toggles in kernels/paged_attention.py;
# the trigger became the default (ae81398) and the toggles were removed: a record of what ran.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
for t in 0 1 0 1; do
  SPLITFLASH_ATTN_TRIGGER=$t timeout 110 python3 -m bench.verify_step --contexts 512 32768 \
    185000 --q-lens 16 1 --reps 100 --json-out "$OUT/vs_t${t}_$RANDOM.json" 2>&1 \
    | grep -E "^ +(512|32768|185000) " | sed "s/^/t$t /"
done
for t in 0 1; do
  SPLITFLASH_ATTN_TRIGGER=$t timeout 60 python3 -m bench.verify_step --contexts 185000 \
    --batches 8 --q-lens 16 --reps 50 2>&1 | grep -E "^ +185000 " | sed "s/^/t$t /"
done
