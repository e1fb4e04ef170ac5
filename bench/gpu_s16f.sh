#!/bin/bash
# Session 16, device calls 4-6: the incident's measurement again, now with a warm-up run per
# way and divergences diagnosed (bench/long_context.py). The model travels in thirds:
#   call 4: carry [".whl", ".model/a"], bash bench/gpu_s16f.sh a   (+ the 185k step profile)
#   call 5: carry [".model/b"],         bash bench/gpu_s16f.sh b
#   call 6: carry [".whl", ".model/c"], bash bench/gpu_s16f.sh c
mkdir -p "$HOME/m" && cp ".model/$1"/* "$HOME/m/" || exit 1
[ "$1" = b ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
if [ "$1" = a ]; then
  timeout 100 python3 -m bench.verify_step --contexts 185000 --q-lens 16 --reps 50 --profile \
    --json-out "$OUT/verify_step_profile_185k.json" 2>&1 | grep -v Warn | tail -30
  exit 0
fi
cat "$HOME"/m/part-* > "$HOME/m/model.gguf" && sha256sum "$HOME/m/model.gguf"
TRITON_PRINT_AUTOTUNING=1 timeout 560 python3 -m bench.long_context --device cuda \
  --target "$HOME/m/model.gguf" --contexts 1400 32768 185000 --windows checkpoint off \
  --max-tokens 128 --json-out "$OUT/long_context_h200.json" > "$OUT/long_context.log" 2>&1
echo "rc $?"; grep -c "Autotuning kernel" "$OUT/long_context.log"
grep -E "^ctx|differs|LOSSY|Error|error" "$OUT/long_context.log" | tail -30
