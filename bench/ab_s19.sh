#!/bin/bash
# Session 19, carry [".whl", "before"]: the batch-invariant verify step, session 18's code
# (before/ = splitflash + bench of commit c56dbe2) against this tree, alternated twice.
# Made with: git worktree add /tmp/b c56dbe2; mkdir before; cp -r /tmp/b/{splitflash,bench} before/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>/dev/null
run(){ (cd $1 && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 1 16 --reps 50 --batch-invariant --json-out $OUT/vs_inv_$2.json 2>&1 | grep -E "^ +(512|32768|185000) " | sed "s/^/$2 /"); }
run before s18_1; run . s19_1; run before s18_2; run . s19_2
