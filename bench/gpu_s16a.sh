#!/bin/bash
# Prepared in session 15 for the next session's first device call (not yet run).
# Set-up on the host, before the call (both trees git-ignored through .git/info/exclude):
#   rm -rf before exp && mkdir before exp
#   git archive c317248 splitflash bench pyproject.toml | tar -x -C before  # draft graphs' 4 copies
#   git archive exp/attn-pdl splitflash bench pyproject.toml | tar -x -C exp  # attention PDL toggle
#   then run with carry [".whl", "before", "exp"].
# 1. GPU tests of the draft graphs' one-copy load (9919a3b) and the pinned feature copies.
# 2. Draft graphs: c317248 (before/) against this tree, alternated.
# 3. A step's context features into the drafter, per request vs batched (aefca33), on the GPU.
# 4. Attention launched with PDL behind a RoPE kernel that triggers only at exit
#    (SPLITFLASH_ATTN_PDL=1 in exp/) against off, alternated.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_draft_graphs.py \
  tests/unit/test_feature_batches.py 2>&1 | tail -3
dg() {
  (cd "$1" && PYTHONPATH=$PWD:/tmp/site timeout 120 python3 -m bench.draft_graphs --contexts 2048 \
    131072 --batches 1 8 --reps 50 --json-out "$OUT/dg_$2.json" 2>&1 | grep -v Warn | tail -6)
}
dg before before1; dg . after1; dg before before2; dg . after2
timeout 60 python3 -m bench.context_append --device cuda --batches 1 8 32 --reps 100 2>&1 \
  | grep -v Warn | tail -3
for a in 0 1 0 1; do
  (cd exp && SPLITFLASH_ATTN_PDL=$a PYTHONPATH=$PWD:/tmp/site timeout 80 python3 -m \
    bench.verify_step --contexts 512 185000 --q-lens 16 --reps 80 \
    --json-out "$OUT/vs_attn_pdl${a}_$SECONDS.json" 2>&1 | grep -E "^ +(512|185000) " \
    | sed "s/^/pdl$a /")
done
