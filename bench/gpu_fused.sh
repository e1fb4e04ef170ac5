#!/usr/bin/env bash
# Device call for issue 5's fused small-M linears + programmatic dependent launch (carry: .whl),
# most important first, every step logged to $OUT/log.txt:
#   1. tile configs of the fused linears vs the unfused ops (bench/linear_sweep.py); the
#      config with the best total over the four shapes is used in step 2 as well;
#   2. the verify step of the default model's shape at 512 / 185k, side by side: fused + PDL
#      (the default), the same with the swept config, unfused without PDL, unfused with PDL on
#      RoPE / attention / combine only.
set -uo pipefail
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
echo "== linear sweep"; date +%T
timeout 200 python3 -m bench.linear_sweep --json-out "$OUT/linear_sweep.json" 2>&1 | tail -12
best=$(python3 - "$OUT/linear_sweep.json" <<'P'
import json, sys, collections
rows = json.load(open(sys.argv[1]))["results"]
tot = collections.defaultdict(float); n = collections.Counter()
for r in rows:
    if r["config"]:
        tot[tuple(r["config"])] += r["us"]; n[tuple(r["config"])] += 1
full = [c for c in tot if n[c] == max(n.values())]
print(",".join(map(str, min(full, key=tot.get))))
P
)
echo "best total config: $best"; date +%T
for variant in "fused_pdl 1 1 -" "fused_pdl_swept 1 1 $best" "unfused 0 0 -" "unfused_pdl 0 1 -"; do
  set -- $variant
  cfg=$4; [ "$cfg" = "-" ] && cfg=""
  echo "== verify_step $1"; date +%T
  SPLITFLASH_FUSED_LINEAR=$2 SPLITFLASH_PDL=$3 SPLITFLASH_LINEAR_CONFIG=$cfg timeout 70 \
    python3 -m bench.verify_step --contexts 512 185000 --q-lens 16 --reps 40 --profile \
    --json-out "$OUT/verify_step_$1.json" 2>&1 | grep -v "^    .*us .*x  " | tail -3
done
date +%T
