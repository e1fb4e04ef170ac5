"""Triton paged verify/decode attention: split-KV flash-decoding with a reduction pass.

Grid: (num_splits * m_tiles, B, H_KV), the row tile fastest: the m_tiles programs that read
the same key range launch side by side, so their K/V re-reads hit L2. One program owns one
request, one KV head, one tile of BLOCK_M query rows and one contiguous range of keys. Rows
are (query, group head) pairs flattened as r = i * G + g, so every query head sharing a KV
head reads that K/V tile once (GQA). Keys are addressed per token through the page table,
so any page size works. The ancestor mask is computed from anc_bits for keys of the drafted
block (the last q_len keys); prefix keys are never masked: full prefix tiles run with no
mask at all, only the one partial tile where a split's prefix range ends checks bounds.
Softmax statistics and accumulation are fp32. With ROPE the kernel also rotates q and takes
the block's keys from the step's projection rows, writing them into the pages
(kernels/rope_rows.py): the step needs no RoPE + K/V-write launch of its own.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from splitflash.kernels.kv_splits import SPLIT_ALIGN, plan_launch
from splitflash.kernels.online_softmax import attend_tile, attend_tile_full
from splitflash.kernels.paged_attention_ref import MAX_Q_LEN, RopeWrite, check_paged_inputs
from splitflash.kernels.paged_tiles import LOG2E, load_kv_full, load_kv_tile, page_ids, visible_keys
from splitflash.kernels.pdl import pdl_enabled
from splitflash.kernels.rope_rows import block_kv_from_rows, rope_kernel_args, rope_rows
from splitflash.kernels.split_combine import combine_splits
from splitflash.kernels.tuning import (
    autotune_prune,
    autotuned,
    config_set_for,
    interpreter_active,
    kv_bucket,
    next_pow2,
    q_bucket,
)


# Ints that vary per call but not per compiled kernel (autotune keys, grid shape): not
# specialized, so e.g. 4 vs 16 splits do not compile two binaries.
@triton.jit(do_not_specialize=["num_splits", "m_tiles", "KV_BUCKET", "Q_BUCKET", "CC"])
def _paged_attn_kernel(
    q_ptr,  # [N, H, D]
    k_ptr,  # [P, S, H_KV, D]
    v_ptr,  # [P, S, H_KV, D]
    page_table_ptr,  # [B, max_pages] int32
    kv_lens_ptr,  # [B]
    cu_q_ptr,  # [B+1]
    anc_ptr,  # [N] int64
    out_ptr,  # [N, H, D] (written when DIRECT_OUT: a single split)
    part_out_ptr,  # [N, H, num_splits, D] fp32 (in q's dtype: 3-5% slower, RESULTS s35)
    part_lse_ptr,  # [N, H, num_splits] fp32
    kn_ptr, vn_ptr,  # ROPE: [N, H_KV, D] the block's unrotated k and its v (rope_rows.py)
    cos_ptr, sin_ptr,  # ROPE: [N, D]
    slots_ptr,  # ROPE: [N] flat KV slots the block's K/V are written to
    qk_scale,  # scale * log2(e): softmax in base 2
    stride_qn, stride_qh,
    stride_kn, stride_knh, stride_vn, stride_vnh, stride_cn,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    max_pages, num_splits, m_tiles,
    KV_BUCKET, Q_BUCKET, CC,  # autotune keys only
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr, UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr,
    SPLIT_ALIGN: tl.constexpr, TRIGGER: tl.constexpr, ROPE: tl.constexpr,
    ROPE_KEYS: tl.constexpr = 16,
):  # fmt: skip
    if TRIGGER:  # the split combine may launch (PDL) once every program has started
        tl.extra.cuda.gdc_launch_dependents()
    split = tl.program_id(0) // m_tiles
    m_tile = tl.program_id(0) % m_tiles
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q0
    if m_tile * BLOCK_M >= q_len * G:
        return  # this request has fewer rows than the widest one in the batch
    kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
    prefix = kv_len - q_len
    pages_ptr = page_table_ptr + b * max_pages

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    qi = rows // G
    head = kv_head * G + rows % G
    row_ok = qi < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ptrs = q_ptr + (q0 + qi)[:, None] * stride_qn + head[:, None] * stride_qh
    q_mask = row_ok[:, None] & d_ok[None, :]
    if ROPE:  # rounded as the RoPE kernel's q output is
        cs_rows = (q0 + qi)[:, None] * stride_cn
        q = rope_rows(q_ptrs, cs_rows, cos_ptr, sin_ptr, offs_d, q_mask, D // 2)
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(q_ptrs + offs_d[None, :], mask=q_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    anc = tl.load(anc_ptr + q0 + qi, mask=row_ok, other=0)  # [BLOCK_M] int64

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile stays nan-free
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys per split from THIS request's length, a multiple of SPLIT_ALIGN (so of BLOCK_N:
    # tiles stay aligned). The host plans only the split count, for an upper bound of the
    # lengths (a CUDA graph's KV bucket, up to 2x the real length): sized from the bound,
    # the splits past a shorter request's end would idle (measured on the H200: 1.65 vs
    # 1.29 ms of attention per 185k-token verify step), while here every split has work.
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), SPLIT_ALIGN) * SPLIT_ALIGN
    start = split * split_len
    end = tl.minimum(start + split_len, kv_len)
    p_end = tl.minimum(end, prefix)  # this split's prefix keys are [start, p_end)
    full_end = start + tl.maximum(p_end - start, 0) // BLOCK_N * BLOCK_N
    # Full prefix tiles: every key visible to every row, no bound checks (the hot loop).
    # The page ids of the NEXT tile are loaded one iteration ahead and carried: with the
    # page load feeding the K/V addresses inside one iteration, Triton's pipeliner spends a
    # stage on it and only double-buffers K/V, waiting for all copies every iteration (no
    # overlap of loads and math); carried, K/V get num_stages buffers.
    last_page = tl.maximum(p_end - 1, 0) // PAGE
    page = page_ids(pages_ptr, start + tl.arange(0, BLOCK_N), last_page, PAGE)  # [BLOCK_N]
    for n0 in range(start, full_end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_full(
            k_ptr, v_ptr, page, t, kv_head,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            PAGE, BLOCK_D, D, UPCAST,
        )  # fmt: skip
        page = page_ids(pages_ptr, t + BLOCK_N, last_page, PAGE)
        m_i, l_i, acc = attend_tile_full(q, k, v, m_i, l_i, acc, qk_scale, DOT_IEEE)
    # At most one partial prefix tile, where the prefix ends inside this split.
    if full_end < p_end:
        t, k, v = load_kv_tile(
            k_ptr, v_ptr, pages_ptr, full_end, p_end, kv_head,
            stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            PAGE, BLOCK_N, BLOCK_D, D, UPCAST,
        )  # fmt: skip
        visible = (t < p_end)[None, :]
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)
    # Block keys (at most 64, so at most a tile or two): ancestor mask. Node j = t - prefix
    # is visible to a row iff bit j of the row's anc_bits is set.
    if ROPE:  # K/V from the step's rows, the first row tile writing them to the pages; in
        # 16-key tiles: at 128 keys the rotation's operands spilled (H100: attention 53 ->
        # 66 us a layer at 185k keys)
        for n0 in range(tl.maximum(start, prefix), end, ROPE_KEYS):
            t = n0 + tl.arange(0, ROPE_KEYS)
            k, v = block_kv_from_rows(
                t, t < end, prefix, q0, kv_head, offs_d, d_ok,
                kn_ptr, vn_ptr, stride_kn, stride_knh, stride_vn, stride_vnh,
                cos_ptr, sin_ptr, stride_cn, slots_ptr,
                k_ptr, v_ptr, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                m_tile == 0, D // 2, PAGE,
            )  # fmt: skip
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            visible = visible_keys(t, end, prefix, anc)
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)
    else:
        for n0 in range(tl.maximum(start, prefix), end, BLOCK_N):
            t, k, v = load_kv_tile(
                k_ptr, v_ptr, pages_ptr, n0, end, kv_head,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                PAGE, BLOCK_N, BLOCK_D, D, UPCAST,
            )  # fmt: skip
            visible = visible_keys(t, end, prefix, anc)
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l = 0: the split saw no visible key
    o = acc / l_safe[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if DIRECT_OUT:
        dst = out_ptr + ((q0 + qi) * H + head)[:, None] * D + offs_d[None, :]
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = ((q0 + qi) * H + head) * num_splits + split  # [BLOCK_M]
        o_part = o.to(part_out_ptr.dtype.element_ty)
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], o_part, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@lru_cache(maxsize=8)
def _tuned_kernel(set_name: str):
    # CC is in the key as well as in the set choice: one process may drive mixed GPUs.
    key = ["KV_BUCKET", "Q_BUCKET", "CC", "D", "G", "PAGE", "BLOCK_M", "DIRECT_OUT"]
    return autotuned(_paged_attn_kernel, set_name, key, prune=autotune_prune)


def paged_attention_triton(
    q: torch.Tensor,  # [N, H, D]
    k_pages: torch.Tensor,  # [P, S, H_KV, D]
    v_pages: torch.Tensor,  # [P, S, H_KV, D]
    page_table: torch.Tensor,  # [B, max_pages] int32
    kv_lens: torch.Tensor,  # [B] int32
    cu_q: torch.Tensor,  # [B+1] int32
    anc_bits: torch.Tensor,  # [N] int64
    scale: float,
    *,
    max_kv_len: int | None = None,
    max_q_len: int | None = None,
    num_splits: int | None = None,
    waves: float | None = None,
    config: tuple[int, int, int] | None = None,
    block_m: int | None = None,
    rope: RopeWrite | None = None,
) -> torch.Tensor:  # [N, H, D]
    """Same contract as paged_attention_ref; with rope, that of rope_kv_write_ref (q, rope.k,
    rope.v, ...) followed by paged_attention_ref on its rotated q (kernels/rope_rows.py).
    max_kv_len / max_q_len are upper bounds the caller usually knows (scheduler); passing
    them avoids a device->host sync. Overrides for
    tests and sweeps: num_splits (split count), waves (programs per SM, see plan_splits),
    config = (BLOCK_N, num_warps, num_stages) instead of autotuning, block_m (rows per program,
    kv_splits.plan_launch)."""
    group = check_paged_inputs(q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits)
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        raise ValueError("k_pages / v_pages must be contiguous in the head dim")
    n_rows, n_heads, head_dim = q.shape
    n_req = page_table.shape[0]
    n_kv_heads, page_size = k_pages.shape[2], k_pages.shape[1]
    out = torch.empty_like(q)
    if n_rows == 0 or n_req == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    page_table = page_table.contiguous()
    rope_ptrs, rope_strides = rope_kernel_args(q, rope, k_pages, v_pages)
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max())
    if max_q_len is None:
        max_q_len = int((cu_q[1:] - cu_q[:-1]).max())
    if not 1 <= max_q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len must be in 1..{MAX_Q_LEN}, got max {max_q_len}")

    lp = plan_launch(q.device, max_q_len * group, max_q_len, n_req, n_kv_heads, max_kv_len,
                     config=config, num_splits=num_splits, waves=waves,
                     head_dim=head_dim, block_m=block_m)  # fmt: skip
    n_splits = lp.splits.num_splits
    direct = n_splits == 1
    if direct:
        part_out = part_lse = out  # unused by the kernel
    else:
        part_out = torch.empty(n_rows, n_heads, n_splits, head_dim,
                               device=q.device, dtype=torch.float32)  # fmt: skip
        part_lse = torch.empty(n_rows, n_heads, n_splits, device=q.device, dtype=torch.float32)
    upcast = interpreter_active() or q.dtype == torch.float32
    cap = lp.capability
    args = (
        q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits, out, part_out, part_lse,
        *rope_ptrs, scale * LOG2E, q.stride(0), q.stride(1), *rope_strides,
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        page_table.shape[1], n_splits, lp.m_tiles,
        kv_bucket(max_kv_len), q_bucket(max_q_len), cap[0] * 10 + cap[1],
    )  # fmt: skip
    meta = dict(
        H=n_heads, G=group, D=head_dim, PAGE=page_size, BLOCK_M=lp.block_m,
        BLOCK_D=max(16, next_pow2(head_dim)), DIRECT_OUT=direct, UPCAST=upcast,
        DOT_IEEE=upcast, SPLIT_ALIGN=SPLIT_ALIGN,
        TRIGGER=not direct and pdl_enabled(q.device), ROPE=rope is not None,
    )  # fmt: skip
    # Row tile fastest (see module docstring): programs sharing a key range run together.
    grid = (n_splits * lp.m_tiles, n_req, n_kv_heads)
    if lp.config is not None:
        block_n, warps, stages = lp.config
        _paged_attn_kernel[grid](*args, **meta, BLOCK_N=block_n, num_warps=warps,
                                 num_stages=stages)  # fmt: skip
    else:
        _tuned_kernel(config_set_for(cap))[grid](*args, **meta)
    if not direct:
        combine_splits(part_out, part_lse, out)
    return out
