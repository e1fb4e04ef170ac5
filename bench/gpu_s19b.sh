#!/bin/bash
# Session 19, carry [".whl"]: after the wide-K invariant config (K > 1024: (32, 256, 4, 3)):
# the GPU tests of the fused linears and batch invariance, then down + residual's chain time
# under both candidate configs at M 1 / 16 / 128 (64-row tiles above 16).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONPATH=$PWD:/tmp/site
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/unit/test_kernels_fused_linear.py \
  tests/unit/test_batch_invariant.py 2>&1 | grep -E "passed|failed|Error|assert" | tail -6
timeout 60 python3 - <<'PY' 2>&1 | grep -v Warn
from bench.linear_sweep import _chain_us, _steps
for m in (1, 16, 128):
    _, fused = _steps("down_res", m, invariant=True)
    for cfg in ((32, 128, 4, 3), (32, 256, 4, 3)):
        print(f"down_res M {m:3d} {cfg}: {_chain_us(lambda: fused(cfg), 60, 20):.2f} us/link")
PY
