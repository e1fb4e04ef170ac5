"""Reduction pass of split-KV (flash-decoding) attention, shared by the paged verify kernel
and the drafter kernel, and the fixed-order reduction of the batch-invariant kernel.

Each split wrote a softmax-normalised partial output and its log-sum-exp (base 2, since the
main kernels use exp2). The true output is the LSE-weighted mean of the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.pdl import gdc_sync, pdl_launch
from splitflash.kernels.tuning import next_pow2


@triton.jit
def _combine_kernel(
    part_out_ptr,  # [N, H, S, D] fp32 per-split normalised outputs
    part_lse_ptr,  # [N, H, S] fp32: per-split log2-sum-exp2 (-inf: split saw no key)
    out_ptr,  # [N, H, D] output dtype
    num_splits,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    gdc_sync(USE_GDC)  # the partials come from the attention kernel (kernels/pdl.py)
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    base = (row * H + head) * num_splits
    lse = tl.load(part_lse_ptr + base + offs_s, mask=s_ok, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # A row that saw no key at all (invalid mask from the caller) would give inf - inf = nan;
    # shift by 0 instead so it comes out as zeros.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)  # [BLOCK_S]
    w_sum = tl.sum(w, axis=0)
    w_sum = tl.where(w_sum > 0.0, w_sum, 1.0)
    o_ptrs = part_out_ptr + (base + offs_s[:, None]) * D + offs_d[None, :]
    o = tl.load(o_ptrs, mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
    acc = tl.sum(o * w[:, None], axis=0) / w_sum  # [BLOCK_D]
    dst = out_ptr + (row * H + head) * D + offs_d
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """part_out [N, H, S, D] fp32, part_lse [N, H, S] fp32 -> writes out [N, H, D]."""
    n_rows, n_heads, num_splits, head_dim = part_out.shape
    if n_rows == 0:
        return
    _combine_kernel[(n_rows, n_heads)](
        part_out,
        part_lse,
        out,
        num_splits,
        H=n_heads,
        D=head_dim,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **pdl_launch(out.device),
    )


@triton.jit(do_not_specialize=["n_granules"])
def _combine_in_order_kernel(
    part_out_ptr,  # [N, H, n_granules, D] fp32
    part_lse_ptr,  # [N, H, n_granules] fp32
    out_ptr,  # [N, H, D]
    n_granules,
    D: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """out = sum_g w_g * o_g / sum_g w_g, w_g = 2^(lse_g - max lse). The sums run over
    chunks of CHUNK granules at fixed granule indices: one fixed-shape tl.sum per chunk (the
    same tree whatever the launch, zeros past a row's last granule), the chunks added in
    order. The max is exact in any order."""
    base = tl.program_id(0) * n_granules  # program = one (row, head)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    m = tl.full([], float("-inf"), tl.float32)
    for g0 in range(0, n_granules, CHUNK):
        offs = g0 + tl.arange(0, CHUNK)
        lse = tl.load(part_lse_ptr + base + offs, mask=offs < n_granules, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, axis=0))
    m = tl.where(m == float("-inf"), 0.0, m)  # a row with no key at all: zeros, not nan
    acc = tl.zeros([BLOCK_D], tl.float32)
    w_sum = tl.full([], 0.0, tl.float32)
    for g0 in range(0, n_granules, CHUNK):
        offs = g0 + tl.arange(0, CHUNK)
        g_ok = offs < n_granules
        w = tl.exp2(tl.load(part_lse_ptr + base + offs, mask=g_ok, other=float("-inf")) - m)
        o = tl.load(part_out_ptr + (base + offs)[:, None] * D + offs_d[None, :],
                    mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
        acc += tl.sum(w[:, None] * o, axis=0)
        w_sum += tl.sum(w, axis=0)
    w_sum = tl.where(w_sum > 0.0, w_sum, 1.0)
    dst = out_ptr + tl.program_id(0) * D + offs_d
    tl.store(dst, (acc / w_sum).to(out_ptr.dtype.element_ty), mask=d_ok)


# Partial elements per in-order combine chunk ([chunk, BLOCK_D] fp32 over 4 warps: 32 registers per
# thread). A model's head dim is fixed, so is its chunk: 64 granules at D 64, 32 at D 128.
# Small, because a chunk's masked tail is work too: at 8 x 32k (44 granules) chunks of 256
# made the combine 15.6 us of the layer's ~120 (H200 profile, bench/RESULTS.md).
COMBINE_ELEMS = 4096


def combine_in_order(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """out [N, H, D] from granule partials part_out [N, H, G, D] / part_lse [N, H, G] (fp32),
    summed in granule order so a row's bits never depend on the launch (the batch-invariant
    attention's reduction)."""
    n_rows, n_heads, n_gran, head_dim = part_out.shape
    _combine_in_order_kernel[(n_rows * n_heads,)](
        part_out, part_lse, out, n_gran,
        D=head_dim, BLOCK_D=next_pow2(head_dim),
        CHUNK=max(16, COMBINE_ELEMS // next_pow2(head_dim)), num_warps=4,
    )  # fmt: skip
