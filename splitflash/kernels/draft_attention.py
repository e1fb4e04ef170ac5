"""Triton drafter block attention over [context ring buffer | block keys].

Layout and semantics: see draft_attention_ref (same arguments), which are exactly those of
the drafter's `block_attention`: block query i (position n_ctx + i) sees context position p
iff n_ctx + i - p < W on a sliding layer, and the block keys under the causal / window
rules. Grid: (num_splits, R * m_tiles, H_KV). Rows are (block query, group head) pairs
r = i * G + g so all query heads of one KV head share each K/V tile (GQA). The context a
request reads (n_read = min(n_ctx, W - 1) entries for a sliding layer, n_ctx for a full one)
is split across programs; split 0 also takes the block keys. Loop bounds stop at n_read, so
a sliding layer never loads more than W - 1 context keys, whatever n_ctx is: reads are
bounded by the loop, the per-query window is a mask inside those tiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import torch
import triton
import triton.language as tl

from splitflash.kernels.draft_attention_ref import (
    check_draft_inputs,
    context_reads,
    context_span,
)
from splitflash.kernels.kv_splits import plan_splits
from splitflash.kernels.online_softmax import attend_tile
from splitflash.kernels.split_combine import combine_splits
from splitflash.kernels.tuning import (
    CONFIG_SETS,
    INTERPRETER_CONFIG,
    autotuned,
    config_set_for,
    device_facts,
    draft_pick,
    interpreter_active,
    kv_bucket,
    next_pow2,
)

_LOG2E = 1.4426950408889634
_INTERPRETER_SMS = 4


@triton.jit
def _draft_attn_kernel(
    q_ptr,  # [R, B_blk, H, D] contiguous
    bk_ptr, bv_ptr,  # [R, B_blk, H_KV, D] contiguous
    ck_ptr, cv_ptr,  # [C, W_cap, H_KV, D] contiguous
    n_ctx_ptr,  # [R]
    slots_ptr,  # [R]
    out_ptr,  # [R, B_blk, H, D] (DIRECT_OUT)
    part_out_ptr,  # [R * B_blk, H, num_splits, D] fp32
    part_lse_ptr,  # [R * B_blk, H, num_splits] fp32
    keys_read_ptr,  # [R] int32 (COUNT_READS)
    qk_scale, window, w_cap, num_splits, m_tiles,
    KV_BUCKET, CC,  # autotune keys only
    BLK: tl.constexpr, H: tl.constexpr, H_KV: tl.constexpr, G: tl.constexpr,
    D: tl.constexpr, SLIDING: tl.constexpr, CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_N: tl.constexpr,
    DIRECT_OUT: tl.constexpr, UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr,
    COUNT_READS: tl.constexpr,
):  # fmt: skip
    split = tl.program_id(0)
    r = tl.program_id(1) // m_tiles
    m_tile = tl.program_id(1) % m_tiles
    kv_head = tl.program_id(2)
    n = tl.load(n_ctx_ptr + r).to(tl.int32)
    n_read = n
    if SLIDING:  # the anchor (block query 0) sees positions > n - W: the W - 1 newest
        n_read = tl.minimum(n, window - 1)
    first = n - n_read  # absolute position of the first context entry read
    slot = tl.load(slots_ptr + r).to(tl.int64)

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = rows // G
    head = kv_head * G + rows % G
    row_ok = qi < BLK
    qpos = n + qi  # [BLOCK_M] absolute position of each row's query
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_rows = (r * BLK + qi) * H + head  # [BLOCK_M] row index into [R * B_blk * H]
    q = tl.load(q_ptr + q_rows[:, None] * D + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys per split from this request's reads (whole BLOCK_N tiles): the host plans only
    # the split count, for a bound (a CUDA graph's context bucket) that may be up to 2x the
    # reads; sized from it, the splits past the reads would idle.
    split_len = tl.cdiv(tl.cdiv(n_read, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, n_read)
    n_loaded = tl.zeros([], tl.int32)
    ring_base = ck_ptr + slot * w_cap * H_KV * D + kv_head * D
    vring_base = cv_ptr + slot * w_cap * H_KV * D + kv_head * D
    for k0 in range(start, end, BLOCK_N):
        kt = k0 + tl.arange(0, BLOCK_N)
        kt_ok = kt < end
        kpos = first + kt  # [BLOCK_N] absolute context positions
        ring = (kpos % w_cap).to(tl.int64)  # ring-buffer slots
        off = ring[:, None] * (H_KV * D) + offs_d[None, :]
        kv_mask = kt_ok[:, None] & d_ok[None, :]
        k = tl.load(ring_base + off, mask=kv_mask, other=0.0)
        v = tl.load(vring_base + off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        visible = kt_ok[None, :]
        if SLIDING:  # per-query window; causality holds for every context key (p < n)
            visible = visible & ((qpos[:, None] - kpos[None, :]) < window)
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)
        n_loaded += tl.sum(kt_ok.to(tl.int32), axis=0)

    if split == 0:
        bt = tl.arange(0, BLOCK_B)
        bt_ok = bt < BLK
        off = ((r * BLK + bt) * H_KV + kv_head)[:, None] * D + offs_d[None, :]
        kv_mask = bt_ok[:, None] & d_ok[None, :]
        k = tl.load(bk_ptr + off, mask=kv_mask, other=0.0)
        v = tl.load(bv_ptr + off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        rel = qi[:, None] - bt[None, :]  # [BLOCK_M, BLOCK_B] query pos - key pos
        visible = bt_ok[None, :]
        if CAUSAL:
            visible = visible & (rel >= 0)
        if SLIDING:
            visible = visible & (rel < window)
            if not CAUSAL:
                visible = visible & (-rel < window)
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)

    # One program per (request, split) counts, so the sum is keys read per request and head.
    if COUNT_READS and kv_head == 0 and m_tile == 0:
        tl.atomic_add(keys_read_ptr + r, n_loaded)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l = 0: the split saw no visible key
    o = acc / l_safe[:, None]
    o_mask = row_ok[:, None] & d_ok[None, :]
    if DIRECT_OUT:
        tl.store(out_ptr + q_rows[:, None] * D + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)  # fmt: skip
    else:
        part = q_rows * num_splits + split
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], o, mask=o_mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


@lru_cache(maxsize=8)
def _tuned_kernel(set_name: str):
    key = ["KV_BUCKET", "CC", "BLK", "D", "G", "SLIDING", "CAUSAL", "BLOCK_M", "DIRECT_OUT"]
    return autotuned(_draft_attn_kernel, set_name, key)


def draft_attention_triton(
    q: torch.Tensor,  # [R, B_blk, H, D]
    blk_k: torch.Tensor,  # [R, B_blk, H_KV, D]
    blk_v: torch.Tensor,  # [R, B_blk, H_KV, D]
    ctx_k: torch.Tensor,  # [C, W_cap, H_KV, D]
    ctx_v: torch.Tensor,  # [C, W_cap, H_KV, D]
    n_ctx: torch.Tensor | Sequence[int],  # [R]
    window: int | None,
    scale: float,
    *,
    causal: bool = False,
    cache_slots: torch.Tensor | Sequence[int] | None = None,  # [R]
    max_ctx_len: int | None = None,
    num_splits: int | None = None,
    keys_read: torch.Tensor | None = None,  # [R] int32, incremented by context keys loaded
    config: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # [R, B_blk, H, D]
    """Same contract as draft_attention_ref. max_ctx_len (>= every n_ctx) sizes the split
    plan; for a full layer given a device n_ctx it avoids a device->host sync (a sliding
    layer is bounded by W - 1 without one). Host n_ctx (a sequence) is checked per request
    against W_cap; a device n_ctx only through max_ctx_len. config = (BLOCK_N, num_warps,
    num_stages) instead of the measured pick / autotuning (sweeps)."""
    group = check_draft_inputs(q, blk_k, blk_v, ctx_k, ctx_v, window)
    n_req, blk, n_heads, head_dim = q.shape
    w_cap, n_kv_heads = ctx_k.shape[1], ctx_k.shape[2]
    out = torch.empty_like(q)
    if n_req == 0 or blk == 0:
        return out
    dev = q.device
    n_ctx_t = torch.as_tensor(n_ctx, dtype=torch.int32, device=dev)
    if cache_slots is None:
        slots_t = torch.arange(n_req, dtype=torch.int32, device=dev)
    else:
        slots_t = torch.as_tensor(cache_slots, dtype=torch.int32, device=dev)
    if n_ctx_t.shape != (n_req,) or slots_t.shape != (n_req,):
        raise ValueError(f"n_ctx and cache_slots must have R={n_req} entries")
    if keys_read is not None and (keys_read.shape != (n_req,) or keys_read.dtype != torch.int32):
        raise ValueError("keys_read must be an int32 tensor of shape [R]")
    if not (ctx_k.is_contiguous() and ctx_v.is_contiguous()):
        # Copying would silently duplicate the whole cache on every call.
        raise ValueError("ctx_k / ctx_v must be contiguous [C, W_cap, H_KV, D] tensors")
    q, blk_k, blk_v = (t.contiguous() for t in (q, blk_k, blk_v))
    bound = _read_bound(n_ctx, n_ctx_t, window, w_cap, max_ctx_len)
    if w_cap == 0:  # an empty cache (every n_ctx is 0): a 1-row stand-in, never read
        ctx_k = ctx_v = q.new_zeros(max(1, ctx_k.shape[0]), 1, n_kv_heads, head_dim)
        w_cap = 1

    interp = interpreter_active()
    if interp or not q.is_cuda:
        cap, sm_count = (0, 0), _INTERPRETER_SMS
    else:
        cap, sm_count = device_facts(q.device.index or 0)
    block_m = min(max(16, next_pow2(blk * group)), 64)
    m_tiles = -(-blk * group // block_m)
    plan = plan_splits(max(bound, 1), n_req * m_tiles * n_kv_heads, sm_count, num_splits)
    direct = plan.num_splits == 1
    n_rows = n_req * blk
    if direct:
        part_out = part_lse = out
    else:
        part_out = torch.empty(n_rows, n_heads, plan.num_splits, head_dim,
                               device=dev, dtype=torch.float32)  # fmt: skip
        part_lse = torch.empty(n_rows, n_heads, plan.num_splits, device=dev, dtype=torch.float32)
    upcast = interp or q.dtype == torch.float32
    args = (
        q, blk_k, blk_v, ctx_k, ctx_v, n_ctx_t, slots_t, out, part_out, part_lse,
        keys_read if keys_read is not None else n_ctx_t,
        scale * _LOG2E, window if window is not None else w_cap, w_cap,
        plan.num_splits, m_tiles,
        kv_bucket(bound), cap[0] * 10 + cap[1],
    )  # fmt: skip
    meta = dict(
        BLK=blk, H=n_heads, H_KV=n_kv_heads, G=group, D=head_dim, SLIDING=window is not None,
        CAUSAL=bool(causal),
        BLOCK_M=block_m, BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_B=max(16, next_pow2(blk)),
        DIRECT_OUT=direct, UPCAST=upcast, DOT_IEEE=upcast, COUNT_READS=keys_read is not None,
    )  # fmt: skip
    grid = (plan.num_splits, n_req * m_tiles, n_kv_heads)
    if config is None and interp:
        config = INTERPRETER_CONFIG
    if config is None:
        config = draft_pick(cap, head_dim)
    if config is None and keys_read is not None:
        # The autotuner re-runs the kernel while timing configs, which would add to the
        # keys_read counter many times over: counting calls take one fixed config.
        config = CONFIG_SETS[config_set_for(cap)][0]
    if config is not None:
        block_n, warps, stages = config
        _draft_attn_kernel[grid](*args, **meta, BLOCK_N=block_n, num_warps=warps,
                                 num_stages=stages)  # fmt: skip
    else:
        _tuned_kernel(config_set_for(cap))[grid](*args, **meta)
    if not direct:
        combine_splits(part_out, part_lse, out)
    return out


def _read_bound(n_ctx, n_ctx_t, window: int | None, w_cap: int, max_ctx_len: int | None) -> int:
    """Most context entries any request reads (sizes the split plan), checked against W_cap
    wherever that needs no device->host sync."""
    if not isinstance(n_ctx, torch.Tensor):  # host ints: exact, per request
        spans = [context_span(int(n), window, w_cap, r) for r, n in enumerate(n_ctx)]
        return max((n_read for _, n_read in spans), default=0)
    if max_ctx_len is None:
        if window is not None:
            return window - 1  # no sync: the window alone bounds the reads
        max_ctx_len = int(n_ctx_t.max())  # device->host sync
    bound = context_reads(int(max_ctx_len), window)
    if bound > w_cap:
        need = "n_ctx" if window is None else f"min(n_ctx, W - 1) for W={window}"
        raise ValueError(f"the ring must hold {need}: W_cap {w_cap} < {bound}")
    return bound
