"""Reduction pass of split-KV (flash-decoding) attention, shared by the paged verify kernel
and the drafter kernel.

Each split wrote a softmax-normalised partial output and its log-sum-exp (base 2, since the
main kernels use exp2). The true output is the LSE-weighted mean of the partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.pdl import gdc_sync, pdl_launch


@triton.jit
def _combine_kernel(
    part_out_ptr,  # [N, H, S, D] fp32: per-split normalised outputs
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
    o = tl.load(o_ptrs, mask=s_ok[:, None] & (offs_d[None, :] < D), other=0.0)
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
