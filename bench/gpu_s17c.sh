#!/bin/bash
# Session 17, device call 6 (carry [".whl"]): the invariant attention with the prefix tiles'
# mask built without the ancestor bits, and two key-axis plans alternated
# (SPLITFLASH_INVARIANT_PLAN=even: equal granule counts per program, fewer programs; unset:
# about two programs per SM, shares differing by one granule), against the fast kernels.
# A record: the toggle was removed after this run ("even" was no faster), so the even rows
# now repeat the share plan.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_kernels_paged_invariant.py \
  tests/unit/test_batch_invariant.py 2>&1 | tail -2
run() {
  timeout 60 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 16 1 --reps 50 \
    $2 --json-out "$OUT/vs_$1.json" 2>&1 | grep -E "^ +(512|32768|185000) " | sed "s/^/$1 /"
}
for i in 1 2; do
  run fast$i ""
  SPLITFLASH_INVARIANT_PLAN=share run share$i --batch-invariant
  SPLITFLASH_INVARIANT_PLAN=even run even$i --batch-invariant
done
SPLITFLASH_INVARIANT_PLAN=share timeout 40 python3 -m bench.verify_step --contexts 185000 \
  --q-lens 16 --reps 20 --batch-invariant --profile 2>&1 | grep -A4 "graph replay"
