#!/bin/bash
# Session 22's plan, run in session 23 on an H100 (a, b, c, scale), then c again (gate v4).
#   carry [".model/a"]: bash bench/gpu_s23.sh a;  carry [".model/b"]: bash bench/gpu_s23.sh b
#   carry [".whl", ".model/c"]: bash bench/gpu_s23.sh c
#     the speculation gate (per context bucket, v4) against target-only and DFlash, as in
#     gpu_s20b.sh: bench.long_context --gate at 1.4k / 8k / 32k / 185k
#   carry [".whl"]: bash bench/gpu_s23.sh scale
#     the verify step of Llama-3-8B's shape (random weights) against its bytes floor
#   carry [".whl"]: bash bench/gpu_s23.sh profile
#     a CUPTI profile of both shapes' 185k q16 step (where the time goes)
#   carry [".whl", ".model/c"]: bash bench/gpu_s23.sh d  (after a, b)
#     gate v4's window and probe interval varied at 1.4k / 8k, where the drafter's acceptance
#     changes within a generation (monkeypatched module constants: nothing else changes)
if [ "$1" = a ] || [ "$1" = b ] || [ "$1" = c ] || [ "$1" = d ]; then
  part=$1; [ "$1" = d ] && part=c  # d brings the last third, as c does
  mkdir -p "$HOME/m" && cp ".model/$part"/* "$HOME/m/" || exit 1
  [ "$1" = a ] || [ "$1" = b ] && exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site
if [ "$1" = c ]; then
  cat "$HOME"/m/part-* > "$HOME/m/model.gguf" && sha256sum "$HOME/m/model.gguf"
  timeout 480 python3 -m bench.long_context --device cuda --target "$HOME/m/model.gguf" \
    --contexts 1400 8192 32768 185000 --windows checkpoint --gate --max-tokens 128 \
    --json-out "$OUT/long_context_gate_v4.json" > "$OUT/long_context_gate_v4.log" 2>&1
  echo "rc $?"
  grep -E "^ctx|differs|LOSSY|Error|error" "$OUT/long_context_gate_v4.log" | tail -30
elif [ "$1" = d ]; then
  cat "$HOME"/m/part-* > "$HOME/m/model.gguf" && sha256sum "$HOME/m/model.gguf"
  for v in "32 32" "16 32" "16 16" "32 16"; do
    set -- $v
    timeout 120 python3 -c "import sys, splitflash.services.gateway.spec_gate as g
g.WINDOW = $1; g.SpecGate.__dataclass_fields__['probe_every'].default = $2
g.SpecGate.__init__.__defaults__ = tuple($2 if d == 32 else d for d in g.SpecGate.__init__.__defaults__)
from bench.long_context import main; sys.exit(main(sys.argv[1:]))" --device cuda \
      --target "$HOME/m/model.gguf" --contexts 1400 8192 --windows checkpoint --gate \
      --max-tokens 128 --json-out "$OUT/gate_w$1_p$2.json" 2>&1 | grep -E "^ctx|Error"
  done
  timeout 60 python3 -m bench.flush_probe --target "$HOME/m/model.gguf" 2>&1 | tail -8
elif [ "$1" = scale ]; then
  timeout 420 python3 -m bench.verify_step --shape llama3-8b --contexts 512 185000 \
    --q-lens 16 1 --reps 30 --json-out "$OUT/verify_step_llama3_8b.json" 2>&1 | tail -20
elif [ "$1" = profile ]; then
  for shape in llama3-8b smollm2-135m; do
    timeout 270 python3 -m bench.verify_step --shape $shape --contexts 185000 --q-lens 16 \
      --reps 30 --profile --json-out "$OUT/verify_step_profile_${shape}.json" 2>&1 | tail -24
  done
fi
