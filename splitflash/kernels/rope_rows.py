"""RoPE and the paged K/V write inside the verify attention kernel (paged_attention.py given a
`paged_attention_ref.RopeWrite`): the step's RoPE + K/V-write launch (rope_kv.py) folded away.

Why: a verify step launched one RoPE + K/V-write kernel per layer between the qkv linear and
attention, ~2 us of GPU time plus a launch boundary each, for 16 rows. Attention already
loads every row's q; it can rotate it on the way in. The block's own keys (the last q_len
keys, at most 64) it then takes from the projection's rows instead of the pages, rotated the
same way and rounded to the pages' dtype, and the first row tile of each key range writes
them into their slots for later steps. No program of the launch reads a block key from the
pages, so the writes race with nothing.

The arithmetic is rope_kv's, term for term (x * c - x' * s for the first half, x * c + x' * s
for the second, fp32, one rounding), so the pages and q hold the bits the two-kernel path
gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.paged_attention_ref import RopeWrite
from splitflash.kernels.rope_kv import check_rope_inputs


@triton.jit
def rope_rows(x_ptrs, cs_rows, cos_ptr, sin_ptr, offs_d, mask, HALF: tl.constexpr):
    """Rotate-half RoPE of rows in fp32: x_ptrs [R, 1] row starts, cs_rows [R, 1] offsets of
    the rows' cos/sin, offs_d [BLOCK_D]; masked-off entries come out 0. -> [R, BLOCK_D]."""
    first = (offs_d < HALF)[None, :]
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)[None, :]
    x = tl.load(x_ptrs + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptrs + partner, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(cos_ptr + cs_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + cs_rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    return tl.where(first, x * c - xp * s, x * c + xp * s)


@triton.jit
def block_kv_from_rows(
    t, t_ok, prefix, q0, kv_head, offs_d, d_ok,
    kn_ptr, vn_ptr, stride_kn, stride_knh, stride_vn, stride_vnh,
    cos_ptr, sin_ptr, stride_cn, slots_ptr,
    k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    write, HALF: tl.constexpr, PAGE: tl.constexpr,
):  # fmt: skip
    """K, V [len(t), BLOCK_D] of block keys at positions t (t_ok: in range) from the step's
    projection rows q0 + t - prefix, K rotated; both in the pages' dtype. write (bool): also
    store them into the pages at the rows' slots."""
    row = (q0 + t - prefix).to(tl.int64)  # [len(t)]
    mask = t_ok[:, None] & d_ok[None, :]
    k_rows = kn_ptr + row[:, None] * stride_kn + kv_head * stride_knh
    k = rope_rows(k_rows, row[:, None] * stride_cn, cos_ptr, sin_ptr, offs_d, mask, HALF)
    k = k.to(k_ptr.dtype.element_ty)
    v_rows = vn_ptr + row[:, None] * stride_vn + kv_head * stride_vnh + offs_d[None, :]
    v = tl.load(v_rows, mask=mask, other=0.0).to(v_ptr.dtype.element_ty)
    if write:
        slot = tl.load(slots_ptr + row, mask=t_ok, other=0).to(tl.int64)
        page, off = slot // PAGE, slot % PAGE
        k_dst = k_ptr + page[:, None] * stride_kp + off[:, None] * stride_ks
        v_dst = v_ptr + page[:, None] * stride_vp + off[:, None] * stride_vs
        tl.store(k_dst + kv_head * stride_kh + offs_d[None, :], k, mask=mask)
        tl.store(v_dst + kv_head * stride_vh + offs_d[None, :], v, mask=mask)
    return k, v


def rope_kernel_args(
    q: torch.Tensor, rope: RopeWrite | None, k_pages, v_pages
) -> tuple[tuple, tuple]:
    """The attention kernel's RoPE pointers (k, v, cos, sin, slots) and strides (k row, k head,
    v row, v head, cos row), checked; q's and zeros without rope (q rotated, pages only)."""
    if rope is None:
        return (q, q, q, q, q), (0, 0, 0, 0, 0)
    check_rope_inputs(q, rope.k, rope.v, rope.cos, rope.sin, k_pages, v_pages, rope.slots)
    n, head_dim = q.shape[0], q.shape[2]
    cos, sin = rope.cos.reshape(n, head_dim), rope.sin.reshape(n, head_dim)
    if cos.stride(0) != sin.stride(0) or cos.stride(1) != 1 or sin.stride(1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    if cos.dtype != q.dtype or sin.dtype != q.dtype:  # rope_kv_write would promote q
        raise ValueError(f"cos / sin must be q's dtype {q.dtype}, got {cos.dtype}, {sin.dtype}")
    k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (rope.k, rope.v))
    pointers = (k, v, cos, sin, rope.slots.contiguous())
    return pointers, (k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0))
