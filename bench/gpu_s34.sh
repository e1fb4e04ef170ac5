#!/bin/bash
# For the next device call (H100 or H200). carry [".whl"].
#   bash bench/gpu_s34.sh p   (~420 s) split partials in fp32 (shipped) against q's dtype
#        (SPLITFLASH_ATTN_PARTIALS=input: half their bytes), split counts 1.5-4 programs per
#        SM, the issue's shape (q 16; batch 1 x 8k / 32k / 128k, batch 8 x 32k) and the
#        default model's (185k, 32k); each compiled variant's registers and shared memory;
#        the paged kernels' GPU tests with bf16 partials
source bench/gpu_setup.sh

if [ "$1" = p ]; then
  for parts in fp32 input; do
    SPLITFLASH_ATTN_PARTIALS=$parts timeout 110 python3 -m bench.kernel_sweep --time-limit 100 \
      --points 1:32768:16 1:8192:16 1:131072:16 8:32768:16 --configs 64,4,3 32,4,3 \
      --waves 1.5 2 3 4 --out "$OUT/sweep_issue_$parts.json" 2>&1 | tail -6 | sed "s|^|$parts |"
    SPLITFLASH_ATTN_PARTIALS=$parts timeout 90 python3 -m bench.kernel_sweep --time-limit 80 \
      --shape 9,3,64 --points 1:185000:16 1:32768:16 --configs 128,4,3 64,4,3 \
      --waves 1.5 2 3 4 --out "$OUT/sweep_135m_$parts.json" 2>&1 | tail -4 | sed "s|^|$parts |"
  done
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
  SPLITFLASH_ATTN_PARTIALS=input timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/unit/test_kernels_paged.py tests/unit/test_kernels_paged_paths.py 2>&1 | tail -2
fi
# q (~140 s, for a short device budget): the partials A/B at the issue's shape only, one
# config, then the paged kernels' GPU tests with bf16 partials
if [ "$1" = q ]; then
  for parts in fp32 input; do
    SPLITFLASH_ATTN_PARTIALS=$parts timeout 50 python3 -m bench.kernel_sweep --quick \
      --time-limit 45 --points 1:32768:16 1:8192:16 8:32768:16 --configs 64,4,3 \
      --waves 1.5 2 3 --out "$OUT/sweep_issue_$parts.json" 2>&1 | grep -E "B=|copy" \
      | sed "s|^|$parts |"
  done
  SPLITFLASH_ATTN_PARTIALS=input timeout 60 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/unit/test_kernels_paged.py 2>&1 | tail -2
fi
