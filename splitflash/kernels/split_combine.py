"""Reduction pass of split-KV (flash-decoding) attention, shared by the paged verify kernel
and the drafter kernel.

Each split wrote a softmax-normalised partial output and its log-sum-exp (base 2, since the
main kernels use exp2). The true output is the LSE-weighted mean of the partials.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitflash.kernels.pdl import gdc_sync, pdl_launch


@triton.jit
def _combine_kernel(
    part_out_ptr,  # [N, H, S, D] fp32 or fp16: per-split normalised outputs
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


def partials_fp16(dtype: torch.dtype) -> bool:
    """Store the split outputs in fp16 rather than fp32 for inputs of this dtype?
    SPLITFLASH_ATTN_PARTIALS=fp16 (16-bit inputs only). Why: at batch 1 and q 16 the
    partials are 6-12% of the bytes the attention launch moves (16 rows x H x S x D fp32,
    written, then read by the combine). Off by default until measured (bench/RESULTS.md,
    session 31). A partial is a weighted mean of V rows, so it stays within V's range; fp16
    keeps 11 bits of it (the bf16 output keeps 8)."""
    wanted = os.environ.get("SPLITFLASH_ATTN_PARTIALS", "fp32").strip().lower()
    if wanted not in ("fp32", "fp16"):
        raise ValueError(f"SPLITFLASH_ATTN_PARTIALS must be fp32 or fp16, got {wanted!r}")
    return wanted == "fp16" and dtype in (torch.float16, torch.bfloat16)


def split_buffers(n_rows: int, n_heads: int, n_splits: int, head_dim: int,
                  q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(part_out [N, H, S, D], part_lse [N, H, S] fp32) for a split launch over q's rows."""
    dtype = torch.float16 if partials_fp16(q.dtype) else torch.float32
    part_out = torch.empty(n_rows, n_heads, n_splits, head_dim, device=q.device, dtype=dtype)
    return part_out, torch.empty(part_out.shape[:3], device=q.device, dtype=torch.float32)


def combine_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """part_out [N, H, S, D] fp32 / fp16, part_lse [N, H, S] fp32 -> writes out [N, H, D]."""
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
