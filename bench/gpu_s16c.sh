#!/bin/bash
# Session 16, device call 1 of 3, back to back. Carry [".whl", ".model/a"]: the model's first
# third is kept in $HOME/m for call 3 (the tracked tree is 21 MB, so a 98 MB model needs three
# calls: split -n 3 into .model/{a,b,c}).
# 1. GPU tests: draft graphs (one-copy load, 9919a3b), pinned feature copies, and the paged
#    kernel's bf16 tests + graph-vs-eager with the attention PDL experiment on (mode 2).
# 2. Attention PDL experiment (kernels/paged_attention.py _attn_pdl, rope_kv EARLY_TRIGGER),
#    verify step at 512 / 185k, q 16, variants alternated:
#    a0e: now (attention not PDL, RoPE triggers early)
#    a1l: attention PDL, waits first; RoPE triggers at exit
#    a2e: attention PDL, page ids + first K/V tile before the wait; RoPE triggers early
#    a2l: same, RoPE triggers at exit
#    a3e: first tile peeled, no PDL (the peel alone)
mkdir -p "$HOME/m" && cp .model/a/* "$HOME/m/"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_draft_graphs.py \
  tests/unit/test_feature_batches.py 2>&1 | tail -2
SPLITFLASH_ATTN_PDL=2 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/unit/test_kernels_paged.py tests/unit/test_verify_graphs.py 2>&1 | tail -2
vs() {
  SPLITFLASH_ATTN_PDL=$1 SPLITFLASH_ROPE_TRIGGER=$2 timeout 70 python3 -m bench.verify_step \
    --contexts 512 185000 --q-lens 16 --reps 80 --json-out "$OUT/vs_$3_$SECONDS.json" 2>&1 \
    | grep -E "^ +(512|185000) " | sed "s/^/$3 /"
}
vs 0 early a0e; vs 2 early a2e; vs 1 late a1l; vs 2 late a2l; vs 3 early a3e
vs 0 early a0e; vs 2 early a2e; vs 2 late a2l
