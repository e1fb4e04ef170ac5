#!/bin/bash
# Session 20: the gateway's speculation gate against the incident's measurement. Three calls
# back to back, the model in thirds (host side as in gpu_s16f.sh):
#   carry [".model/a"]: bash bench/gpu_s20b.sh a;  carry [".model/b"]: bash bench/gpu_s20b.sh b
#   carry [".whl", ".model/c"]: bash bench/gpu_s20b.sh c
#     bench.long_context, target-only / DFlash / DFlash under the gate (--gate), fast kernels
mkdir -p "$HOME/m" && cp ".model/$1"/* "$HOME/m/" || exit 1
[ "$1" != c ] && exit 0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
cat "$HOME"/m/part-* > "$HOME/m/model.gguf" && sha256sum "$HOME/m/model.gguf"
timeout ${LC_TIMEOUT:-360} python3 -m bench.long_context --device cuda \
  --target "$HOME/m/model.gguf" --contexts ${LC_CONTEXTS:-1400 8192 32768 185000} \
  --windows checkpoint --gate --max-tokens 128 \
  --json-out "$OUT/long_context_gate_h200.json" > "$OUT/long_context_gate.log" 2>&1
echo "rc $?"
grep -E "^ctx|differs|LOSSY|Error|error" "$OUT/long_context_gate.log" | tail -30
