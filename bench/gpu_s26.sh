#!/bin/bash
# Session 26 (no machine could be started in any of its tries: all of this is queued).
# carry [".whl"]; `before/` travels as an untracked folder, made with
#   mkdir before && git archive b7c3765 splitflash bench | tar -x -C before &&
#   cp bench/graph_memory.py before/bench/ && rm -rf before/bench/results before/splitflash/assets
#
#   bash bench/gpu_s26.sh short   the GPU tests of the graphs (shared outputs under real
#        capture, replayed in alternating order), then bench.graph_memory before (b7c3765)
#        and after the graphs of one row count share their outputs
#   bash bench/gpu_s26.sh mem     the same, alternated twice, plus the warm-up GPU tests
#   git apply bench/patches/norm_stats_modes.patch, then bash bench/gpu_s26.sh norm (or all):
#        where the norm linears take their rows' mean square (the patch adds the
#        SPLITFLASH_NORM_MODE toggle for this measurement only): before the K loop (0, as
#        shipped), inside it from the MMA operand (1), loaded before it and summed after (2);
#        link time in a chain at M 16, the verify step at 512 / 185k alternated, and the
#        step's per-kernel profile at 185k q 16
#   bash bench/gpu_s26.sh a | f   as bench/gpu_s25.sh
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$1" = short ]; then  # the shared graph outputs under real capture, and their memory
  timeout 170 python3 -m pytest -q -m gpu tests/unit/test_verify_graphs.py \
    tests/unit/test_draft_graphs.py 2>&1 | tail -2
  for t in before .; do
    echo "== $t"; (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 70 python3 -m bench.graph_memory \
      --batches 1 8 32 --q-lens 16 --contexts 512 3000 \
      --json-out "$OUT/graph_memory_$(basename $(realpath $t)).json" 2>&1 | grep -E "B +[0-9]")
  done
elif [ "$1" = all ]; then  # one call of what matters most (device time was short): carry .whl, before
  timeout 170 python3 -m pytest -q -m gpu tests/unit/test_verify_graphs.py \
    tests/unit/test_draft_graphs.py 2>&1 | tail -2
  for t in before .; do
    echo "== $t"; (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 70 python3 -m bench.graph_memory \
      --batches 1 8 32 --q-lens 16 --contexts 512 3000 \
      --json-out "$OUT/graph_memory_$(basename $(realpath $t)).json" 2>&1 | grep -E "B +[0-9]")
  done
  for m in 0 1 2 0; do
    SPLITFLASH_NORM_MODE=$m timeout 75 python3 -m bench.verify_step --contexts 185000 512 \
      --q-lens 16 --reps 30 --json-out "$OUT/vs_norm${m}_$SECONDS.json" 2>&1 | grep -E "\] ctx"
  done
elif [ "$1" = norm ]; then
  timeout 150 python3 - <<'PY' 2>&1 | grep -v Warning
import json, os
from bench.linear_sweep import _steps, _chain_us
rows = []
for name in ("norm_qkv", "norm_gate_up"):
    _, fused = _steps(name, 16)
    for cfg in ((16, 64, 4, 4), (32, 64, 4, 4), (16, 128, 4, 3)):
        line = []
        for mode in (0, 1, 2, 0):
            os.environ["SPLITFLASH_NORM_MODE"] = str(mode)
            us = _chain_us(lambda c=cfg: fused(c), 60, 30)
            rows.append(dict(shape=name, config=cfg, mode=mode, us=us)); line.append(f"m{mode} {us:5.2f}")
        print(name, cfg, " ".join(line), flush=True)
json.dump(rows, open(os.environ["OUT"] + "/norm_modes_chain.json", "w"), indent=1)
PY
  for i in 1 2; do for m in 0 1 2; do
    SPLITFLASH_NORM_MODE=$m timeout 100 python3 -m bench.verify_step --contexts 512 185000 \
      --q-lens 16 --reps 40 --json-out "$OUT/vs_norm${m}_$i.json" 2>&1 | grep -E "\] ctx" 
  done; done
  timeout 100 python3 -m bench.verify_step --contexts 185000 --q-lens 16 --reps 20 --profile \
    --json-out "$OUT/vs_profile.json" 2>&1 | grep -vE "Warning" | tail -30
  timeout 150 python3 -m pytest -q -m gpu tests/unit/test_verify_graphs.py tests/unit/test_draft_graphs.py 2>&1 | tail -3
elif [ "$1" = mem ]; then  # carry also before/ (b7c3765's splitflash + this bench)
  for t in before . before .; do
    echo "== $t"; (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m bench.graph_memory \
      --batches 1 8 32 --q-lens 1 16 --contexts 512 3000 \
      --json-out "$OUT/graph_memory_$(basename $(realpath $t)).json" 2>&1 | grep -E "B +[0-9]")
  done
  timeout 150 python3 -m pytest -q -m gpu tests/unit/test_verify_graphs.py \
    tests/unit/test_draft_graphs.py tests/unit/test_warmup.py 2>&1 | tail -3
elif [ "$1" = a ] || [ "$1" = f ]; then
  bash bench/gpu_s25.sh "$1"
fi
