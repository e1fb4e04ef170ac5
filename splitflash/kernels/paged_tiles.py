"""Tile helpers shared by the paged attention kernels (paged_attention.py, the fast one, and
paged_attention_invariant.py): K/V tiles read through a request's page table, and which
keys each query row sees.
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def load_kv_tile(
    k_ptr, v_ptr, pages_ptr, n0, end, kv_head,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Token positions t [BLOCK_N] from n0 and their K, V [BLOCK_N, BLOCK_D] (zeros past end),
    read through the request's page-table row pages_ptr. For partial tiles."""
    t = n0 + tl.arange(0, BLOCK_N)
    t_ok = t < end
    page = tl.load(pages_ptr + t // PAGE, mask=t_ok, other=0).to(tl.int64)
    slot = t % PAGE
    offs_d = tl.arange(0, BLOCK_D)
    mask = t_ok[:, None] & (offs_d < D)[None, :]
    k_off = page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :]
    v_off = page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :]
    k = tl.load(k_ptr + k_off + kv_head * stride_kh, mask=mask, other=0.0)
    v = tl.load(v_ptr + v_off + kv_head * stride_vh, mask=mask, other=0.0)
    if UPCAST:  # the interpreter's bf16 is broken: fp32 right after the load
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return t, k, v


@triton.jit
def page_ids(pages_ptr, t, last_page, PAGE: tl.constexpr):
    """Physical page [BLOCK_N] int64 of token positions t; indices past last_page are
    clamped to it, so a look-ahead past the range reads a valid entry and needs no mask."""
    return tl.load(pages_ptr + tl.minimum(t // PAGE, last_page)).to(tl.int64)


@triton.jit
def load_kv_full(
    k_ptr, v_ptr, page, t, kv_head,
    stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
    PAGE: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """K, V [BLOCK_N, BLOCK_D] of a full tile: positions t [BLOCK_N] all in range, their
    pages [BLOCK_N] already known. No bound checks (only the head dim when D < BLOCK_D)."""
    slot = t % PAGE
    offs_d = tl.arange(0, BLOCK_D)
    k_off = page[:, None] * stride_kp + slot[:, None] * stride_ks + offs_d[None, :]
    v_off = page[:, None] * stride_vp + slot[:, None] * stride_vs + offs_d[None, :]
    if BLOCK_D == D:
        k = tl.load(k_ptr + k_off + kv_head * stride_kh)
        v = tl.load(v_ptr + v_off + kv_head * stride_vh)
    else:
        d_ok = (offs_d < D)[None, :]
        k = tl.load(k_ptr + k_off + kv_head * stride_kh, mask=d_ok, other=0.0)
        v = tl.load(v_ptr + v_off + kv_head * stride_vh, mask=d_ok, other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def visible_keys(t, end, prefix, anc):
    """[BLOCK_M, BLOCK_N] keys t a row sees: prefix keys all; block node j = t - prefix iff
    bit j of the row's ancestor bits anc [BLOCK_M]; nothing at or past end."""
    j = tl.minimum(tl.maximum(t - prefix, 0), 63).to(tl.int64)
    bit = (anc[:, None] >> j[None, :]) & 1
    return (t < end)[None, :] & ((t < prefix)[None, :] | (bit != 0))
