#!/bin/bash
# Session 24: measured picks instead of autotuning while serving (issue 5, item 4).
# before/ holds tuning.py and draft_attention.py of commit fd522f3 (autotuned q 2..64 and
# drafter attention); each mode swaps them in for its "before" runs.
#   carry [".whl", "before"]: bash bench/gpu_s24.sh a
#     the drafter attention's config sweep; the first step of a new graph key, before/after
#   carry [".whl", "before"]: bash bench/gpu_s24.sh b
#     the verify step at 512 / 185k (q 16 now takes a measured pick), before/after twice,
#     then the GPU tests of the kernels
#   carry [".whl", "before"]: bash bench/gpu_s24.sh c
#     with the drafter pick: the first step again, and the draft step before/after
#   carry [".model/a"]: bash bench/gpu_s24.sh a_model; [".model/b"]: ... b_model; then
#   carry [".whl", ".model/c"]: bash bench/gpu_s24.sh e
#     the real model end to end (the services' loader, so its warm-up): bench.long_context
#     --gate at 1.4k / 8k / 32k, as session 23's mode c
#   carry [".whl"]: bash bench/gpu_s24.sh f
#     engine.verify steps whose requests draft different lengths: padded onto one graph
#     (verify() ms) against the unpadded eager step they ran as before (eager verify() ms)
#   carry [".whl"]: bash bench/gpu_s24.sh d
#     the start-up warm-ups: the first steps after them, and the GPU tests of warm-ups/graphs
if [ "$1" = a_model ] || [ "$1" = b_model ]; then
  mkdir -p "$HOME/m" && cp ".model/${1%_model}"/* "$HOME/m/" && exit 0
  exit 1
fi
if [ "$1" = e ]; then
  mkdir -p "$HOME/m" && cp .model/c/* "$HOME/m/" || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
K=splitflash/kernels
swap() {  # swap before|after: which tuning.py / draft_attention.py are in place
  if [ "$1" = before ]; then
    cp $K/tuning.py /tmp/tuning_new.py; cp $K/draft_attention.py /tmp/draft_new.py
    cp before/tuning.py before/draft_attention.py $K/
  else
    cp /tmp/tuning_new.py $K/tuning.py; cp /tmp/draft_new.py $K/draft_attention.py
  fi
}
nvidia-smi --query-gpu=name --format=csv,noheader
if [ "$1" = a ]; then
  timeout 200 python3 -m bench.draft_attn_sweep --json-out "$OUT/draft_attn_sweep.json" 2>&1 | tail -22
  for way in before after; do
    swap $way
    echo "== first_step $way"
    timeout 150 python3 -m bench.first_step --json-out "$OUT/first_step_$way.json" 2>&1 | tail -16
  done
elif [ "$1" = b ]; then
  for way in before after before after; do
    swap $way
    echo "== verify_step $way"
    timeout 110 python3 -m bench.verify_step --contexts 512 185000 --q-lens 16 1 --reps 30 \
      --json-out "$OUT/verify_step_$way.json" 2>&1 | grep -vE "^\s*$" | tail -6
  done
  timeout 150 python3 -m pytest -q -m gpu tests/unit/test_kernels_paged_paths.py \
    tests/unit/test_kernels_draft.py 2>&1 | tail -4
elif [ "$1" = c ]; then
  for way in before after; do
    swap $way
    echo "== first_step / draft_graphs $way"
    timeout 130 python3 -m bench.first_step --json-out "$OUT/first_step_c_$way.json" 2>&1 | tail -16
    timeout 100 python3 -m bench.draft_graphs --contexts 2048 131072 --batches 1 8 \
      --json-out "$OUT/draft_graphs_$way.json" 2>&1 | tail -4
  done
elif [ "$1" = d ]; then
  timeout 200 python3 -m bench.first_step --warmup --json-out "$OUT/first_step_warmup.json" \
    2>&1 | grep -vE "Warning|capture_end" | tail -20
  timeout 240 python3 -m pytest -q -m gpu tests/unit/test_warmup.py \
    tests/unit/test_verify_graphs.py tests/unit/test_draft_graphs.py 2>&1 | tail -4
elif [ "$1" = e ]; then
  cat "$HOME"/m/part-* > "$HOME/m/model.gguf" && sha256sum "$HOME/m/model.gguf"
  timeout 420 python3 -c "import logging, sys; logging.basicConfig(level=logging.INFO)
from bench.long_context import main; sys.exit(main(sys.argv[1:]))" \
    --device cuda --target "$HOME/m/model.gguf" \
    --contexts 1400 8192 32768 --windows checkpoint --gate --max-tokens 128 \
    --json-out "$OUT/long_context_s24.json" > "$OUT/long_context_s24.log" 2>&1
  echo "rc $?"
  grep -E "^ctx|warm-up|differs|LOSSY|Error|error" "$OUT/long_context_s24.log" | tail -30
elif [ "$1" = f ]; then
  timeout 300 python3 -m bench.verify_step --contexts 512 32768 --batches 4 8 --q-lens 16 \
    --reps 20 --mixed-drafts --json-out "$OUT/verify_step_mixed.json" 2>&1 | tail -6
fi
