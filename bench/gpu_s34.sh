#!/bin/bash
# For the next device call (H100 or H200). carry [".whl"]. Both modes aim at q 16 at batch 1
# x 32k keys (0.75 of copy on an H100, issue 5's target 0.80).
# (SPLITFLASH_ATTN_PARTIALS, mode p, was removed in session 37 after it lost: RESULTS session 35.)
#   bash bench/gpu_s34.sh p   (~330 s) split partials in fp32 (shipped) against q's dtype
#        (SPLITFLASH_ATTN_PARTIALS=input: half their bytes) at 1.5-4 programs per SM, the
#        issue's shape (q 16; batch 1 x 8k / 32k / 128k, batch 8 x 32k) and the default
#        model's (185k, 32k); each compiled variant's registers and shared memory; the paged
#        kernels' GPU tests with bf16 partials
#   bash bench/gpu_s34.sh m   (~260 s) fewer rows per program than the request has (16 / 32 of
#        q 16 x G 4 = 64: K/V re-read from L2, fewer splits and partials) against 64; then a
#        185k prompt in chunks sized to 50 / 100 ms (PREFILL_CHUNK_MS) beside chunks of 8192
#   bash bench/gpu_s34.sh q   (~140 s, for a short device budget) mode p's issue shape only
source bench/gpu_setup.sh

sweep() {  # $1: SPLITFLASH_ATTN_PARTIALS, $2: limit (s), $3: JSON name; the rest: sweep args
  local parts=$1 limit=$2 name=$3; shift 3
  SPLITFLASH_ATTN_PARTIALS=$parts timeout $((limit + 10)) python3 -m bench.kernel_sweep --quick \
    --time-limit "$limit" "$@" --out "$OUT/$name.json" 2>&1 | grep -E "B=|copy" | sed "s|^|$name |"
}

if [ "$1" = p ] || [ "$1" = q ]; then
  for parts in fp32 input; do
    if [ "$1" = q ]; then
      sweep $parts 45 "issue_$parts" --points 1:32768:16 1:8192:16 8:32768:16 \
        --configs 64,4,3 --waves 1.5 2 3
      continue
    fi
    sweep $parts 100 "issue_$parts" --points 1:32768:16 1:8192:16 1:131072:16 8:32768:16 \
      --configs 64,4,3 32,4,3 --waves 1.5 2 3 4
    sweep $parts 70 "135m_$parts" --shape 9,3,64 --points 1:185000:16 1:32768:16 \
      --configs 128,4,3 64,4,3 --waves 1.5 2 3 4
  done
fi
if [ "$1" = p ]; then
  timeout 60 python3 - <<'PY'
import torch
from bench.kernels import _paged_inputs
from splitflash.kernels import paged_attention as pa
gen = torch.Generator(device="cuda").manual_seed(0)
seen = set()
def compiled():
    out = {}
    for cache in pa._paged_attn_kernel.device_caches.values():
        out.update(cache[0])
    return out
for (h, hk, d, cfgs) in ((32, 8, 128, ((64, 4, 3), (32, 4, 3))), (9, 3, 64, ((128, 4, 3), (64, 4, 3)))):
    args = _paged_inputs(1, 32768, 16, h, hk, d, 16, torch.bfloat16, gen, "head")
    for cfg in cfgs:
        pa.paged_attention_triton(*args, 0.1, config=cfg)
        torch.cuda.synchronize()
        for key, k in compiled().items():
            if key not in seen:
                seen.add(key)
                print(f"D={d} config={cfg}: regs={k.n_regs} spills={k.n_spills} "
                      f"shared={k.metadata.shared}", flush=True)
PY
fi
if [ "$1" = m ]; then
  sweep fp32 150 issue_block_m --points 1:32768:16 1:8192:16 8:32768:16 \
    --configs 64,4,3 32,4,3 --block-m 16 32 64 --waves 1 1.5 2 3
  timeout 90 python3 -m bench.prefill --shape smollm2-135m --contexts 185000 --chunks 8192 \
    --chunk-ms 50 100 --reps 2 --json-out "$OUT/prefill_chunk_ms.json" 2>&1 | grep "^ctx"
fi
if [ "$1" = p ] || [ "$1" = q ]; then
  SPLITFLASH_ATTN_PARTIALS=input timeout 90 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/unit/test_kernels_paged.py tests/unit/test_kernels_paged_paths.py 2>&1 | tail -2
fi
