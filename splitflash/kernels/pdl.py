"""Programmatic dependent launch (PDL, Hopper and later) for the verify step's kernel chain.

A small model's verify step is a chain of ~200 short kernels, each waiting for the one before
it: every boundary pays the next kernel's launch and ramp-up while the GPU drains. Launched
with PDL, a kernel's programs may start while the previous kernel still runs, do the work
that does not depend on it (load weights), and block in `gdc_wait` until it has finished
and its writes are visible. Rules every PDL kernel here follows:

- nothing before `gdc_wait` but loads of data no kernel of the step writes (weights);
  in particular no store, since the memory being written may still be read upstream;
- `gdc_wait` on every path before the first dependent load, so completion is transitive
  (a kernel finishes only after the one before it did);
- `gdc_launch_dependents` right after the wait, so the next kernel can be scheduled early.

The attention kernel is NOT launched with PDL. Measured on the H200 (bench/RESULTS.md): PDL
on RoPE / attention / combine made the 185k verify step 0.43 ms slower (2.92 vs 2.49 ms)
while saving 0.15 ms at 512. The likely cause: its grid is planned as exactly one resident
wave (kernels/tuning.py), and programs placed early, next to the previous kernel's, leave
some without a slot until a first one finishes (a second wave for a whole split).

The attention kernel does trigger its dependent early: every program calls
`gdc_launch_dependents` first, so the split combine (PDL) is launched as soon as the last
attention program has started (never before: no combine program can take an attention
program's slot) and waits in `gdc_wait` for the result. Measured on the H200, alternated
(bench/RESULTS.md): the graphed verify step at q 16 went 1.39/1.28 -> 1.02/1.01 ms at 32k and
2.21 -> 1.96 ms at 185k; at q 1 and at 512 keys it gained 1-2%.

Off (USE_GDC False, no launch flag) on CPU, in the interpreter, before sm_90, and with
SPLITFLASH_PDL=0 (to measure with and without, or to rule it out when debugging).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitflash.kernels.tuning import device_facts, interpreter_active


@triton.jit
def gdc_sync(USE_GDC: tl.constexpr):
    """Wait for the previous kernel (its writes visible after this), then let the next one be
    scheduled. A no-op without PDL."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask L2 for the 128-byte line holding each address of ptrs (`prefetch.global.L2`): no
    register receives the data and nothing waits for it, so a program can have many lines
    on their way without holding buffers for them. CUDA only (inline PTX)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)  # fmt: skip


def pdl_enabled(device: torch.device) -> bool:
    """Launch the chain's kernels with PDL on this device?"""
    if device.type != "cuda" or interpreter_active():
        return False
    if os.environ.get("SPLITFLASH_PDL", "1") == "0":
        return False
    return device_facts(device.index or 0)[0][0] >= 9


def pdl_launch(device: torch.device) -> dict:
    """Meta arguments of one launch: USE_GDC for the kernel, launch_pdl for the driver."""
    if pdl_enabled(device):
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}
