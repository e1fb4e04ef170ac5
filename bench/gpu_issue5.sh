#!/usr/bin/env bash
# One time-boxed device call for issue 5, most important first; every step logs to
# $OUT/log.txt so a cut-short call still returns what finished. Carry: .whl
#   1. the end-to-end verify step of the default model's shape (random bf16 weights): eager vs
#      CUDA graph at 512 and 185k context against the bytes floor, with a per-kernel profile;
#   2. the paged-attention sweep at the default model's head shape (9/3 heads of 64), head-
#      vs token-major pages, 185k context, q_len 16 and 1;
#   3. the bf16 GPU tests (kernels vs references, captured graph == eager);
#   4. the kernel bandwidth table (bench/kernels.py, as in serving), batch 1 and 8;
#   5. the q_len 1 sweep at the table's shape (is MEASURED_PICKS' config still the best?).
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,clocks.sm,memory.used --format=csv,noheader
echo "== verify_step"; date +%T
timeout 120 python3 -m bench.verify_step --contexts 512 185000 --q-lens 16 --reps 30 \
  --profile --json-out "$OUT/verify_step.json"
for layout in head token; do
  echo "== sweep model shape, $layout-major pages"; date +%T
  timeout 45 python3 -m bench.kernel_sweep --quick --time-limit 40 --shape 9,3,64 \
    --layout $layout --points 1:185000:16 1:185000:1 8:32768:16 \
    --out "$OUT/sweep_model_$layout.json" 2>&1 | tail -5
done
echo "== gpu tests"; date +%T
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/unit 2>&1 | tail -15
for b in 1 8; do
  echo "== kernels b$b"; date +%T
  timeout 100 python3 -m bench.kernels --batch-sizes $b --out "$OUT/kernels_b$b.json" 2>&1 \
    | tail -16
done
echo "== q1 sweep"; date +%T
timeout 40 python3 -m bench.kernel_sweep --quick --time-limit 35 \
  --points 8:131072:1 1:32768:1 8:32768:1 --out "$OUT/sweep_q1.json" 2>&1 | tail -6
date +%T
