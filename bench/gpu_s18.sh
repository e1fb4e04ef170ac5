#!/bin/bash
# Session 18. Round 1, one call, carry [".whl"]: bash bench/gpu_s18.sh sweep
#   the invariant attention's fixed choices (bench.invariant_sweep) and the graphed draft
#   step with its appends (bench.draft_graphs; session 17's raw file was lost).
# Round 2, three calls back to back, the model in thirds (host side as in gpu_s16f.sh):
#   carry [".whl", ".model/a"]: bash bench/gpu_s18.sh a   GPU tests, the invariant attention
#     against session 17's choices (invariant_sweep --ab), verify_step fast/invariant
#   carry [".model/b"]:         bash bench/gpu_s18.sh b
#   carry [".whl", ".model/c"]: bash bench/gpu_s18.sh c   long_context, fast and invariant
# Round 3, one call, carry [".whl"]: bash bench/gpu_s18.sh shares   GPU tests and --ab again
#   after each program took the granules starting in its equal share of the keys;
# Round 4, the same with "shares restart": an equal share of keys + RESTART_KEYS per granule
# (measured, then removed); round 5 "shares final": one granule per program when programs
# suffice, else key shares, int32 loop bounds.
# Round 6, carry [".whl"]: bash bench/gpu_s18.sh profile   per-kernel GPU time, 8 x 32k q16.
# Round 7, carry [".whl"]: bash bench/gpu_s18.sh combine   the combine in chunks of 64.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
if [ "$1" = sweep ]; then
  timeout 330 python3 -m bench.invariant_sweep --out "$OUT/invariant_sweep_h200.json" 2>&1 \
    | grep -v Warn
  timeout 150 python3 -m bench.draft_graphs --contexts 2048 131072 --batches 1 8 --reps 50 \
    --json-out "$OUT/draft_graphs_appends_h200.json" 2>&1 | grep -v Warn | tail -6
  exit 0
fi
if [ "$1" = shares ]; then  # rounds 3-4 (carry [".whl"]): how granules are shared out
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/unit/test_kernels_paged_invariant.py tests/unit/test_batch_invariant.py 2>&1 | tail -2
  for i in 1 ${2:+2}; do
    timeout 90 python3 -m bench.invariant_sweep --ab \
      --out "$OUT/invariant_ab_${2:-shares}${2:+_$i}_h200.json" 2>&1 | grep -v Warn
  done
  [ "$2" = final ] && for inv in "" --batch-invariant; do
    timeout 100 python3 -m bench.verify_step --contexts 32768 131072 --batches 1 8 --q-lens 16 \
      --reps 30 $inv --json-out "$OUT/verify_step_b8${inv:+_invariant}_h200.json" 2>&1 \
      | grep -E "^ +(32768|131072) " | sed "s/^/${inv:-fast} /"
  done
  exit 0
fi
if [ "$1" = combine ]; then  # round 7 (carry [".whl"]): combine chunks of 64 granules, 4 warps
  timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/unit/test_kernels_paged_invariant.py tests/unit/test_batch_invariant.py 2>&1 | tail -2
  timeout 60 python3 -m bench.invariant_sweep --ab --out "$OUT/invariant_ab_combine_h200.json" \
    2>&1 | grep -v Warn
  timeout 45 python3 -m bench.verify_step --contexts 32768 --batches 8 --q-lens 16 \
    --reps 20 --batch-invariant --json-out "$OUT/verify_step_combine_invariant_h200.json" 2>&1 \
    | grep -E "^ +32768 "
  exit 0
fi
if [ "$1" = profile ]; then  # round 6 (carry [".whl"]): where batch 8's invariant step goes
  for inv in "" --batch-invariant; do
    timeout 120 python3 -m bench.verify_step --contexts 32768 --batches 8 --q-lens 16 \
      --reps 20 --profile $inv --json-out "$OUT/verify_step_b8_profile${inv:+_invariant}_h200.json" \
      2>&1 | grep -E "kernels per step|^ +[0-9.]+ us|^ +32768 " | head -18 | sed "s/^/${inv:-fast} /"
  done
  exit 0
fi
# Calls b and c are session 17's (the model's other thirds, then long_context fast and
# batch-invariant side by side): bench/gpu_s17b.sh.
[ "$1" = a ] || exec bash bench/gpu_s17b.sh "$1"
mkdir -p "$HOME/m" && cp .model/a/* "$HOME/m/" || exit 1
timeout 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
  tests/unit/test_kernels_paged_invariant.py tests/unit/test_batch_invariant.py \
  tests/unit/test_kernels_fused_linear.py tests/unit/test_verify_graphs.py \
  tests/unit/test_draft_graph_appends.py 2>&1 \
  | grep -E "fast kernels|passed|failed|Error|assert" | tail -20
timeout 90 python3 -m bench.invariant_sweep --ab --out "$OUT/invariant_ab_h200.json" 2>&1 \
  | grep -v Warn
for i in 1 2; do
  for inv in "" --batch-invariant; do
    timeout 110 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 16 1 \
      --reps 50 $inv --json-out "$OUT/verify_step${inv:+_invariant}_$i.json" 2>&1 \
      | grep -E "^ +(512|32768|185000) " | sed "s/^/${inv:-fast} /"
  done
done
