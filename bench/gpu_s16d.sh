#!/bin/bash
# Session 16, device call 2 of 3, right after bench/gpu_s16c.sh. Carry [".whl", ".model/b",
# "before"] where before/ is (assets left out, copied on the device)
#   git archive c317248 splitflash bench pyproject.toml | tar -x -C before
# 1. Draft graphs: four pageable copies (c317248, before/) against one pinned copy, alternated.
# 2. A step's context features into the drafter, per request vs batched, on the GPU.
cp .model/b/* "$HOME/m/" || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
cp -r splitflash/assets before/splitflash/  # the shipped drafter (not carried twice)
dg() {
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site timeout 60 python3 -m bench.draft_graphs --contexts 2048 \
    131072 --batches 1 8 --reps 50 --json-out "$OUT/dg_$2.json" 2>&1 | grep -v Warn | tail -6)
}
dg before before1; dg . after1; dg before before2; dg . after2
timeout 60 python3 -m bench.context_append --device cuda --batches 1 8 32 --reps 100 2>&1 \
  | grep -v Warn | tail -4
