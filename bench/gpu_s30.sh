#!/bin/bash
# Session 30 (H200 or H100). carry [".whl", "before"].
#   bash bench/gpu_s30.sh a   the verify step with split-K off / auto (K >= 1024 only)
#        alternated twice; the shipped drafter's graphs; the draft call's host work on this
#        machine's CPU, before (carry before/) and after; the split-K and draft-graph GPU tests
#   bash bench/gpu_s30.sh b   the kernel bench at batch 1 (8k, 32k; q 1, 16); the linears'
#        cold split sweep (fold fixed)
source bench/gpu_setup.sh

if [ "$1" = a ]; then  # most wanted first: a call may be cut off (~240 s at most)
  verify_ab 45 1 auto
  timeout 45 python3 -m bench.draft_graphs --contexts 2048 131072 --batches 1 8 --reps 20 \
    --json-out "$OUT/draft_graphs_shipped.json" 2>&1 | grep -v Warning | tail -4
  # before/: commit 159cef0's splitflash/ and bench/, its bench/draft_host.py replaced by
  # this one minus `greedy=True` (bench/RESULTS.md, session 30); carry it
  [ -d before ] && (cd before && PYTHONPATH=$PWD:/tmp/site timeout 20 python3 -m \
    bench.draft_host --batches 1 8 32 --reps 100 2>&1 | tail -3 | sed "s|^|before |")
  timeout 20 python3 -m bench.draft_host --batches 1 8 32 --reps 100 2>&1 | tail -3 \
    | sed "s|^|after  |"
  timeout 60 python3 -m pytest -q -m gpu tests/unit/test_kernels_split_k.py \
    tests/unit/test_draft_graphs.py tests/unit/test_draft_graph_appends.py 2>&1 | tail -2
  verify_ab 45 1 auto  # run only if the call's limit leaves room
elif [ "$1" = b ]; then  # the rest, if device time is left
  timeout 90 python3 -m bench.kernels --batch-sizes 1 --kv-lens 8192,32768 --q-lens 1,16 \
    --out "$OUT/kernels_b1.json" 2>&1 | tail -6
  timeout 60 python3 -m bench.linear_sweep --splits 1 3 6 0 --cold --rows 16 \
    --reps 15 --json-out "$OUT/linear_split.json" 2>&1 | grep "^M "
fi
