#!/bin/bash
# Session 17: batch-invariant verify steps on the H200. Three calls back to back, the model
# in thirds (the tracked tree is ~21 MB of a call's 64 MiB; host side as in gpu_s16f.sh):
#   call 1: carry [".whl", ".model/a"]: bash bench/gpu_s17b.sh a
#     GPU tests (bf16: a row's bits in any launch, verify block == decode steps on the
#     default model's shape, graphs; fused linears at any M), then bench.verify_step with
#     the fast kernels and batch-invariant, alternated twice.
#   call 2: carry [".model/b"]: bash bench/gpu_s17b.sh b
#   call 3: carry [".whl", ".model/c"]: bash bench/gpu_s17b.sh c
#     bench.long_context, fast and batch-invariant engines side by side (LC_CONTEXTS).
mkdir -p "$HOME/m" && cp ".model/$1"/* "$HOME/m/" || exit 1
[ "$1" = b ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
if [ "$1" = a ]; then
  timeout 240 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
    tests/unit/test_kernels_paged_invariant.py tests/unit/test_batch_invariant.py \
    tests/unit/test_kernels_fused_linear.py tests/unit/test_verify_graphs.py 2>&1 \
    | grep -E "fast kernels|passed|failed|Error|assert" | tail -20
  for i in 1 2; do
    for inv in "" --batch-invariant; do
      timeout 110 python3 -m bench.verify_step --contexts 512 32768 185000 --q-lens 16 1 \
        --reps 50 $inv --json-out "$OUT/vs${inv:+_inv}_$i.json" 2>&1 \
        | grep -E "^ +(512|32768|185000) " | sed "s/^/${inv:-fast} /"
    done
  done
  exit 0
fi
cat "$HOME"/m/part-* > "$HOME/m/model.gguf" && sha256sum "$HOME/m/model.gguf"
timeout ${LC_TIMEOUT:-480} python3 -m bench.long_context --device cuda \
  --target "$HOME/m/model.gguf" --contexts ${LC_CONTEXTS:-1400 8192 32768 185000} \
  --windows checkpoint --invariant off on --max-tokens 128 \
  --json-out "$OUT/long_context_invariant_h200.json" > "$OUT/long_context_invariant.log" 2>&1
echo "rc $?"
grep -E "^ctx|differs|LOSSY|Error|error" "$OUT/long_context_invariant.log" | tail -30
