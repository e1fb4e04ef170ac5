"""TEMPORARY (session 19): do 16-row (mma.sync) and 64-row (wgmma) tiles of the same config give
the same bits per row? The batch-invariant linears at each of the default model's shapes."""
import os
import sys

import torch

from splitflash.kernels.fused_linear import linear_residual_triton, norm_linear_triton

SHAPES = [(576, 960, None), (576, 576, "res"), (576, 1536, "swiglu"), (1536, 576, "res"),
          (576, 49152, None)]
diffs = 0
for k, n, kind in SHAPES:
    for trial in range(40):
        g = torch.Generator(device="cuda").manual_seed(trial)
        m = 16
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16() * (1 + trial % 5)
        nw = (1 + 0.3 * torch.randn(k, device="cuda", generator=g)).bfloat16()
        w = (torch.randn(2 * n if kind == "swiglu" else n, k, device="cuda", generator=g)
             / k**0.5).bfloat16()
        res = torch.randn(m, n, device="cuda", generator=g).bfloat16()
        outs = []
        for tile in ("16", "64"):
            os.environ["SPLITFLASH_INV_TILE"] = tile
            if kind == "res":
                outs.append(linear_residual_triton(x, w, res, invariant=True))
            else:
                outs.append(norm_linear_triton(x, nw, 1e-5, w, n if kind == "swiglu" else None,
                                               invariant=True))
        if not torch.equal(outs[0], outs[1]):
            diffs += 1
            print(f"  {k}x{n} {kind} trial {trial}: differ, max "
                  f"{(outs[0].float() - outs[1].float()).abs().max().item():.3g}")
    print(f"{k}x{n} {kind}: done", flush=True)
print(f"trials differing: {diffs}")
sys.exit(0)
