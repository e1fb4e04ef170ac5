"""Reduction pass of split-KV (flash-decoding) attention, shared by the paged verify kernel
and the drafter kernel.

Each split wrote a softmax-normalised partial output and its log-sum-exp (base 2, since the
main kernels use exp2). The true output is the LSE-weighted mean of the partials.

Two forms: `combine_splits`, a kernel of its own after the attention kernel, and
`combine_if_last`, called inside the attention kernel by every split program of a row tile
once its partials are written: the last program to arrive (an atomic counter per tile)
combines the tile. That saves a launch and a kernel boundary (~1.5-3 us per layer on the
H200) but puts the whole reduction on one program, so the caller takes it only when the
tile's partials are few (paged_attention.FUSED_COMBINE_MAX_BYTES).
"""

from __future__ import annotations

import os

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


@triton.jit
def combine_if_last(
    counter_ptr,  # int32 scalar: programs of this row tile done so far (0 at launch)
    part_out_ptr,  # [N, H, S, D] fp32
    part_lse_ptr,  # [N, H, S] fp32
    out_ptr,  # [N, H, D]
    row_head,  # [BLOCK_M] int: (query row) * H + head of each row of the tile
    row_ok,  # [BLOCK_M] bool
    num_splits,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """After a split program stored its partials: count it in; the last of the tile's
    num_splits programs combines the tile's rows into out and resets the counter (so the next
    launch, or a CUDA graph replay, starts from 0).

    Ordering, the pattern of a grid-wide barrier: the barrier makes every thread's partial
    stores precede the counter's update, which releases them at GPU scope (acq_rel); the
    last program's update acquires every other program's, and its loads bypass L1 (.cg)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if arrived == num_splits - 1:
        tl.debug_barrier()
        tl.atomic_xchg(counter_ptr, 0)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < D
        base = row_head * num_splits  # [BLOCK_M]
        lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for s in range(num_splits):
            lse = tl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            lse_max = tl.maximum(lse_max, lse)
        lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)  # no key seen: zeros
        w_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for s in range(num_splits):
            lse = tl.load(part_lse_ptr + base + s, mask=row_ok, other=float("-inf"),
                          cache_modifier=".cg")  # fmt: skip
            w = tl.exp2(lse - lse_max)  # [BLOCK_M]
            o = tl.load(part_out_ptr + (base + s)[:, None] * D + offs_d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
                        cache_modifier=".cg")  # fmt: skip
            w_sum += w
            acc += o * w[:, None]
        acc = acc / tl.where(w_sum > 0.0, w_sum, 1.0)[:, None]
        dst = out_ptr + row_head[:, None] * D + offs_d[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """n zeroed int32 arrival counters for combine_if_last, kept per device: every launch
    leaves them at zero again, so one buffer serves every launch that runs one at a time on
    the device (the verify step's attention launches do: one stream, in order)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def fused_combine_setting() -> bool:
    """SPLITFLASH_FUSED_COMBINE=0 turns the in-kernel combine off (to measure or rule out)."""
    return os.environ.get("SPLITFLASH_FUSED_COMBINE", "1") != "0"


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
