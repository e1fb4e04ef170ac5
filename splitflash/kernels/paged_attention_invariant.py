"""Batch-invariant paged verify/decode attention: a query row's output is the same bits
whatever the launch it is in (q_len 1 or a verify block, alone or in a batch).

Why: greedy speculative decoding must give target-only decoding's tokens. The fast kernel
(paged_attention.py) sizes its KV splits and tiles from the launch (the longest request, the
q bucket, the GPU), so the row of position p reduces its keys in another order in a 16-token
verify block than in a one-token decode step, and in bf16 a near tie of the target's top two
logits can then flip (measured on the H200 at 32k: bench/RESULTS.md). Here every choice that
sets a row's floating-point order is a function of absolute key positions only:
- keys are cut into fixed granules (sizes grow with key position: granule_start), each
  reduced on its own into a partial (softmax-normalised output, log2-sum-exp2);
- inside a granule, tiles of BLOCK_N keys start at the granule's start; every tile goes
  through the masked fold, so a tile folds the same keys the same way whether the row's
  last key ends the launch (decode) or sits inside the block (verify);
- one fixed tile config and BLOCK_M (no autotuning, no q bucket): the same MMA shapes;
- the combine sums granules in fixed-shape chunks at fixed granule indices, the chunks in
  order (no reduction whose shape would follow the granule count of the launch).
Keys past a row's visibility contribute exact zeros (p = 0, weight 0), and x + 0 == x, so
extra tiles or granules of a longer launch leave the row's bits alone. How many granules a
program walks is free (it does not change any row's arithmetic): that is planned per launch
for occupancy. Cost: partials per granule, a masked fold on every tile, one fixed config
(bench/RESULTS.md measures it against the fast kernel).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.online_softmax import attend_tile
from splitflash.kernels.paged_attention_ref import MAX_Q_LEN, check_paged_inputs
from splitflash.kernels.paged_tiles import LOG2E, load_kv_full, load_kv_tile, page_ids, visible_keys
from splitflash.kernels.split_combine import combine_in_order
from splitflash.kernels.tuning import device_facts, interpreter_active, next_pow2

# Granule sizes by key position: small ones at short contexts (enough programs), larger ones
# far out (fewer partials, fewer per-granule restarts: H200 sweep in bench/RESULTS.md).
GRANULE_SMALL = 256  # keys per granule in [0, SMALL_SPAN)
SMALL_SPAN = 4096
GRANULE = 1024  # keys per granule in [SMALL_SPAN, MID_SPAN)
MID_SPAN = 65536
GRANULE_LARGE = 2048  # keys per granule from MID_SPAN on: 135 partials per row at 185k
BLOCK_M = 64  # query rows per program, whatever q_len (the MMA shape must not vary)
# (BLOCK_N, num_warps, num_stages), fixed per head dim (a model constant, never per launch):
# the best of the H200 sweep at D 64; at D 128 a 128-key tile at 4 warps spills, so the fast
# kernel's q_len-1 pick (tuning.MEASURED_PICKS).
CONFIG_BY_HEAD_DIM = {64: (128, 4, 2)}
CONFIG = (64, 4, 3)
PROGRAMS_PER_SM = 4  # key-axis programs: one granule each at 185k, batch 1 (H200 sweep)


def tile_config(head_dim: int) -> tuple[int, int, int]:
    """The fixed (BLOCK_N, num_warps, num_stages) for a head dim."""
    return CONFIG_BY_HEAD_DIM.get(next_pow2(head_dim), CONFIG)


def granule_count(kv_len: int) -> int:
    """Granules covering keys [0, kv_len): also the first granule starting at or after key
    kv_len."""
    n_small = SMALL_SPAN // GRANULE_SMALL
    if kv_len <= SMALL_SPAN:
        return -(-kv_len // GRANULE_SMALL)
    if kv_len <= MID_SPAN:
        return n_small + -(-(kv_len - SMALL_SPAN) // GRANULE)
    n_mid = n_small + (MID_SPAN - SMALL_SPAN) // GRANULE
    return n_mid + -(-(kv_len - MID_SPAN) // GRANULE_LARGE)


def granule_start(g: int) -> int:
    """First key of granule g (a multiple of GRANULE_SMALL, so of every BLOCK_N)."""
    n_small = SMALL_SPAN // GRANULE_SMALL
    n_mid = n_small + (MID_SPAN - SMALL_SPAN) // GRANULE
    if g < n_small:
        return g * GRANULE_SMALL
    if g < n_mid:
        return SMALL_SPAN + (g - n_small) * GRANULE
    return MID_SPAN + (g - n_mid) * GRANULE_LARGE


@triton.jit
def _granule_start(g, GRANULE_SMALL: tl.constexpr, SMALL_SPAN: tl.constexpr,
                   GRANULE: tl.constexpr, MID_SPAN: tl.constexpr,
                   GRANULE_LARGE: tl.constexpr):  # fmt: skip
    """granule_start on the device."""
    n_small = SMALL_SPAN // GRANULE_SMALL
    n_mid = n_small + (MID_SPAN - SMALL_SPAN) // GRANULE
    mid = tl.where(g < n_mid, SMALL_SPAN + (g - n_small) * GRANULE,
                   MID_SPAN + (g - n_mid) * GRANULE_LARGE)  # fmt: skip
    return tl.where(g < n_small, g * GRANULE_SMALL, mid)


@triton.jit
def _granule_count(n, GRANULE_SMALL: tl.constexpr, SMALL_SPAN: tl.constexpr,
                   GRANULE: tl.constexpr, MID_SPAN: tl.constexpr,
                   GRANULE_LARGE: tl.constexpr):  # fmt: skip
    """granule_count on the device."""
    n_small = SMALL_SPAN // GRANULE_SMALL
    n_mid = n_small + (MID_SPAN - SMALL_SPAN) // GRANULE
    g_mid = n_small + (n - SMALL_SPAN + GRANULE - 1) // GRANULE
    g_large = n_mid + (n - MID_SPAN + GRANULE_LARGE - 1) // GRANULE_LARGE
    g_small = (n + GRANULE_SMALL - 1) // GRANULE_SMALL
    return tl.where(n <= SMALL_SPAN, g_small, tl.where(n <= MID_SPAN, g_mid, g_large))


@triton.jit(do_not_specialize=["n_granules", "n_programs", "m_tiles"])
def _invariant_attn_kernel(
    q_ptr,  # [N, H, D]
    k_ptr,  # [P, S, H_KV, D]
    v_ptr,  # [P, S, H_KV, D]
    page_table_ptr,  # [B, max_pages] int32
    kv_lens_ptr,  # [B]
    cu_q_ptr,  # [B+1]
    anc_ptr,  # [N] int64
    part_out_ptr,  # [N, H, n_granules, D] fp32
    part_lse_ptr,  # [N, H, n_granules] fp32
    qk_scale,  # scale * log2(e)
    stride_qn, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    max_pages, n_granules, n_programs, m_tiles,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr,
    GRANULE_SMALL: tl.constexpr, SMALL_SPAN: tl.constexpr, GRANULE: tl.constexpr,
    MID_SPAN: tl.constexpr, GRANULE_LARGE: tl.constexpr,
):  # fmt: skip
    prog = tl.program_id(0) // m_tiles
    m_tile = tl.program_id(0) % m_tiles
    b = tl.program_id(1)
    kv_head = tl.program_id(2)
    q0 = tl.load(cu_q_ptr + b).to(tl.int32)
    q_len = tl.load(cu_q_ptr + b + 1).to(tl.int32) - q0
    if m_tile * BLOCK_M >= q_len * G:
        return
    kv_len = tl.load(kv_lens_ptr + b).to(tl.int32)
    prefix = kv_len - q_len
    pages_ptr = page_table_ptr + b * max_pages

    rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] = (query, group head)
    qi = rows // G
    head = kv_head * G + rows % G
    row_ok = qi < q_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q_ptrs = q_ptr + (q0 + qi)[:, None] * stride_qn + head[:, None] * stride_qh
    q = tl.load(q_ptrs + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    anc = tl.load(anc_ptr + q0 + qi, mask=row_ok, other=0)  # [BLOCK_M] int64
    part_row = (q0 + qi) * H + head  # [BLOCK_M]
    o_mask = row_ok[:, None] & d_ok[None, :]

    # This program's granules. One each when there are programs enough (measured fastest);
    # else those starting in an equal share of the launch's keys (granules differ in size:
    # equal counts were 1.3x slower at 8 x 131k on the H200). Every granule goes to exactly
    # one program: the combine reads them all.
    if n_programs == n_granules:
        g_lo = prog
        g_hi = prog + 1
    else:
        # int64 products (long contexts x many programs); int32 bounds for the loops' math
        span = _granule_start(n_granules, GRANULE_SMALL, SMALL_SPAN, GRANULE, MID_SPAN,
                              GRANULE_LARGE).to(tl.int64)  # fmt: skip
        g_lo = _granule_count(prog * span // n_programs, GRANULE_SMALL, SMALL_SPAN, GRANULE,
                              MID_SPAN, GRANULE_LARGE).to(tl.int32)  # fmt: skip
        g_hi = _granule_count((prog + 1) * span // n_programs, GRANULE_SMALL, SMALL_SPAN,
                              GRANULE, MID_SPAN, GRANULE_LARGE).to(tl.int32)  # fmt: skip
    for g in range(g_lo, g_hi):
        start = _granule_start(g, GRANULE_SMALL, SMALL_SPAN, GRANULE, MID_SPAN, GRANULE_LARGE)
        end = tl.minimum(
            _granule_start(g + 1, GRANULE_SMALL, SMALL_SPAN, GRANULE, MID_SPAN, GRANULE_LARGE),
            kv_len,
        )
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Whole tiles: page ids carried a tile ahead (see paged_attention.py), no load masks.
        # Every tile, whole or not, folds through the visibility mask: which tiles are whole
        # depends on the launch's kv_len, the fold must not.
        full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
        # Whole tiles of prefix keys only: the mask is all true, built without the ancestor
        # bits (the same values, so the same fold, at a fraction of the integer work).
        pre_end = start + tl.maximum(tl.minimum(end, prefix) - start, 0) // BLOCK_N * BLOCK_N
        last_page = tl.maximum(end - 1, 0) // PAGE
        page = page_ids(pages_ptr, start + tl.arange(0, BLOCK_N), last_page, PAGE)
        for n0 in range(start, pre_end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            k, v = load_kv_full(
                k_ptr, v_ptr, page, t, kv_head,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                PAGE, BLOCK_D, D, UPCAST,
            )  # fmt: skip
            page = page_ids(pages_ptr, t + BLOCK_N, last_page, PAGE)
            visible = (t < end)[None, :] | (rows < 0)[:, None]  # [BLOCK_M, BLOCK_N], all true
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)
        for n0 in range(pre_end, full_end, BLOCK_N):
            t = n0 + tl.arange(0, BLOCK_N)
            k, v = load_kv_full(
                k_ptr, v_ptr, page, t, kv_head,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                PAGE, BLOCK_D, D, UPCAST,
            )  # fmt: skip
            page = page_ids(pages_ptr, t + BLOCK_N, last_page, PAGE)
            visible = visible_keys(t, end, prefix, anc)
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)
        if full_end < end:  # the granule's (or the request's) last, partial tile
            t, k, v = load_kv_tile(
                k_ptr, v_ptr, pages_ptr, full_end, end, kv_head,
                stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                PAGE, BLOCK_N, BLOCK_D, D, UPCAST,
            )  # fmt: skip
            visible = visible_keys(t, end, prefix, anc)
            m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, DOT_IEEE)
        # A granule past the row's keys (or the request's end) leaves l = 0: partial 0, lse
        # -inf, weight 0 in the combine.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        part = part_row * n_granules + g
        tl.store(part_out_ptr + part[:, None] * D + offs_d[None, :], acc / l_safe[:, None],
                 mask=o_mask)  # fmt: skip
        lse = tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=row_ok)


def plan_programs(n_granules: int, n_other: int, sm_count: int) -> int:
    """Programs along the key axis: about PROGRAMS_PER_SM per SM over all (request, kv head,
    row tile) programs n_other, never more than one per granule."""
    return max(1, min(n_granules, -(-PROGRAMS_PER_SM * sm_count // max(1, n_other))))


def paged_attention_invariant(
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
    programs: int | None = None,
) -> torch.Tensor:  # [N, H, D]
    """Same contract as paged_attention_ref, each row's result independent of the launch.
    max_kv_len: an upper bound of kv_lens (no device sync when given); programs: key-axis
    programs per (request, kv head, row tile) instead of the occupancy plan (tests)."""
    group = check_paged_inputs(q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits)
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        raise ValueError("k_pages / v_pages must be contiguous in the head dim")
    n_rows, n_heads, head_dim = q.shape
    n_req, n_kv_heads, page_size = page_table.shape[0], k_pages.shape[2], k_pages.shape[1]
    out = torch.empty(n_rows, n_heads, head_dim, device=q.device, dtype=q.dtype)
    if n_rows == 0 or n_req == 0:
        return out
    q = q if q.stride(2) == 1 else q.contiguous()
    page_table = page_table.contiguous()
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max())
    if max_q_len is None:
        max_q_len = int((cu_q[1:] - cu_q[:-1]).max())
    if not 1 <= max_q_len <= MAX_Q_LEN:
        raise ValueError(f"q_len must be in 1..{MAX_Q_LEN}, got max {max_q_len}")
    n_gran = max(1, granule_count(max_kv_len))
    m_tiles = -(-max_q_len * group // BLOCK_M)
    on_gpu = q.device.type == "cuda" and not interpreter_active()
    sm_count = device_facts(q.device.index or 0)[1] if on_gpu else 4
    n_prog = plan_programs(n_gran, n_req * n_kv_heads * m_tiles, sm_count)
    if programs is not None:
        n_prog = max(1, min(programs, n_gran))
    part_out = torch.empty(n_rows, n_heads, n_gran, head_dim, device=q.device,
                           dtype=torch.float32)  # fmt: skip
    part_lse = torch.empty(n_rows, n_heads, n_gran, device=q.device, dtype=torch.float32)
    upcast = interpreter_active() or q.dtype == torch.float32
    block_n, warps, stages = tile_config(head_dim)
    _invariant_attn_kernel[(n_prog * m_tiles, n_req, n_kv_heads)](
        q, k_pages, v_pages, page_table, kv_lens, cu_q, anc_bits, part_out, part_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        page_table.shape[1], n_gran, n_prog, m_tiles,
        H=n_heads, G=group, D=head_dim, PAGE=page_size, BLOCK_M=BLOCK_M,
        BLOCK_D=max(16, next_pow2(head_dim)), BLOCK_N=block_n, UPCAST=upcast, DOT_IEEE=upcast,
        GRANULE_SMALL=GRANULE_SMALL, SMALL_SPAN=SMALL_SPAN, GRANULE=GRANULE, MID_SPAN=MID_SPAN,
        GRANULE_LARGE=GRANULE_LARGE, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    combine_in_order(part_out, part_lse, out)
    return out
