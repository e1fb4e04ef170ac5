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
graph_tests() {  # the GPU tests of the graphs (shared outputs under real capture), and $@
  timeout 170 python3 -m pytest -q -m gpu tests/unit/test_verify_graphs.py \
    tests/unit/test_draft_graphs.py "$@" 2>&1 | tail -2
}
graph_memory() {  # graph_memory in before/ and this tree, in the order given (q-lens $Q)
  for t in "$@"; do
    echo "== $t"; (cd $t && PYTHONPATH=$PWD:/tmp/site timeout 100 python3 -m bench.graph_memory \
      --batches 1 8 32 --q-lens ${Q:-16} --contexts 512 3000 \
      --json-out "$OUT/graph_memory_$(basename $(realpath $t))_$SECONDS.json" 2>&1 \
      | grep -E "B +[0-9]")
  done
}
norm_steps() {  # the verify step under each norm mode given (the patch applied)
  for m in "$@"; do
    SPLITFLASH_NORM_MODE=$m timeout 100 python3 -m bench.verify_step --contexts 512 185000 \
      --q-lens 16 --reps 40 --json-out "$OUT/vs_norm${m}_$SECONDS.json" 2>&1 | grep -E "\] ctx"
  done
}
if [ "$1" = short ]; then
  graph_tests
  graph_memory before .
elif [ "$1" = all ]; then  # one call of what matters most
  graph_tests
  graph_memory before .
  norm_steps 0 1 2 0
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
  norm_steps 0 1 2 0 1 2
  timeout 100 python3 -m bench.verify_step --contexts 185000 --q-lens 16 --reps 20 --profile \
    --json-out "$OUT/vs_profile.json" 2>&1 | grep -vE "Warning" | tail -30
  graph_tests
elif [ "$1" = mem ]; then
  Q="1 16" graph_memory before . before .
  graph_tests tests/unit/test_warmup.py
elif [ "$1" = a ] || [ "$1" = f ]; then
  bash bench/gpu_s25.sh "$1"
fi
