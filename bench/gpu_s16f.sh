#!/bin/bash
# Session 16, device calls 4-6: the incident's measurement again, now with a warm-up run per
# way, verify / propose time per step and divergences diagnosed (bench/long_context.py). The
# model travels in thirds (the tracked tree is 21 MB of a call's 64 MiB), back to back:
#   call 4: carry [".model/a"],         bash bench/gpu_s16f.sh a
#   call 5: carry [".model/b"],         bash bench/gpu_s16f.sh b
#   call 6: carry [".whl", ".model/c"], bash bench/gpu_s16f.sh c
# Host side first (/.model/ in .git/info/exclude):
#   f=~/.cache/splitflash/models/smollm2-135m/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .model/a .model/b .model/c && split -n 3 -d -a 1 "$f" .model/part- &&
#   mv .model/part-0 .model/a/ && mv .model/part-1 .model/b/ && mv .model/part-2 .model/c/
# The run in bench/RESULTS.md (after the prefill fix): call c with
#   LC_TIMEOUT=270 LC_CONTEXTS="1400 185000 32768"
mkdir -p "$HOME/m" && cp ".model/$1"/* "$HOME/m/" || exit 1
[ "$1" != c ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
cat "$HOME"/m/part-* > "$HOME/m/model.gguf" && sha256sum "$HOME/m/model.gguf"
TRITON_PRINT_AUTOTUNING=1 timeout ${LC_TIMEOUT:-420} python3 -m bench.long_context --device cuda \
  --target "$HOME/m/model.gguf" --contexts ${LC_CONTEXTS:-1400 32768 185000} \
  --windows checkpoint off \
  --max-tokens 128 --json-out "$OUT/long_context_h200.json" > "$OUT/long_context.log" 2>&1
echo "rc $?"; grep -c "Autotuning kernel" "$OUT/long_context.log"
grep -E "^ctx|differs|LOSSY|Error|error" "$OUT/long_context.log" | tail -30
timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_prefill_attention.py \
  2>&1 | tail -2
