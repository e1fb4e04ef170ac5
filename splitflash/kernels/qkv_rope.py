"""RMSNorm + the qkv projection + RoPE + the paged K/V write, in one kernel for few rows.

The reference is the model's own op sequence: norm_linear_ref (RMSNorm, then x @ W_qkv.T),
split into q | k | v heads, rope_kv_write_ref (rotate q and k, write k and v at their
slots). On the GPU a verify step ran this as two kernels per layer, the fused qkv linear
(kernels/fused_linear.py) and the RoPE + KV write (kernels/rope_kv.py): 30 RoPE launches of
~1.9 us per step of the default model, plus the qkv output's round trip through memory.

Why it fuses: RoPE pairs column d of a head with column d + Dh/2 of the same head. A
program here computes BLOCK_P such pairs, as two accumulators: y1 = x @ W[head, d].T and
y2 = x @ W[head, Dh/2 + d].T. The rotation is then elementwise on (y1, y2), and the weight
bytes read are those of the plain GEMM. q heads go to the rotated q output, k heads
(rotated) and v heads (as they are) straight into their cache slots.

Roundings follow the unfused kernels: the projection is rounded to the model's dtype (as
F.linear's output), RoPE is computed in fp32 from that and rounded once (as rope_kv).
Heads with a per-head norm (Qwen3's q_norm / k_norm) need it between the projection and
RoPE: they keep the two-kernel path (fused_dispatch.norm_qkv_rope).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.fused_linear import (
    BLOCK_M,
    MAX_K,
    MAX_M,
    _check,
    _load_rows,
    _precision,
    _prefetch_tile_l2,
    _tile_meta,
    fits,
    fold_norm_weight,
    norm_linear_ref,
)
from splitflash.kernels.online_softmax import dot_nt
from splitflash.kernels.pdl import gdc_sync, pdl_launch
from splitflash.kernels.rope_kv import check_rope_inputs, rope_kv_write_ref
from splitflash.kernels.tuning import next_pow2

BLOCK_P = 16  # rotate-half pairs per program: the smallest tl.dot width


def split_heads(qkv: torch.Tensor, n_heads: int, n_kv_heads: int):
    """qkv [N, (H + 2 H_KV) Dh] -> q [N, H, Dh], k [N, H_KV, Dh], v [N, H_KV, Dh] views."""
    n = qkv.shape[0]
    head_dim = qkv.shape[1] // (n_heads + 2 * n_kv_heads)
    q, k, v = qkv.split([n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim], -1)
    return (q.view(n, n_heads, head_dim), k.view(n, n_kv_heads, head_dim),
            v.view(n, n_kv_heads, head_dim))  # fmt: skip


def _check_qkv(weight: torch.Tensor, n_heads: int, n_kv_heads: int) -> None:
    heads = n_heads + 2 * n_kv_heads
    if n_kv_heads < 1 or weight.shape[0] % heads or (weight.shape[0] // heads) % 2:
        raise ValueError(f"qkv weight of {weight.shape[0]} rows is not {n_heads} q + 2 x "
                         f"{n_kv_heads} kv heads of one even head dim")  # fmt: skip


def norm_qkv_rope_ref(
    x: torch.Tensor,  # [N, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [(H + 2 H_KV) Dh, K], rows q | k | v
    cos: torch.Tensor,  # [N, 1, Dh]
    sin: torch.Tensor,  # [N, 1, Dh]
    k_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    v_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    slots: torch.Tensor,  # [N] flat slots, page * S + offset
    n_heads: int,
    n_kv_heads: int,
) -> torch.Tensor:  # rotated q [N, H, Dh]
    _check_qkv(weight, n_heads, n_kv_heads)
    q, k, v = split_heads(norm_linear_ref(x, norm_weight, eps, weight), n_heads, n_kv_heads)
    return rope_kv_write_ref(q, k, v, cos, sin, k_pages, v_pages, slots)


@triton.jit
def _norm_qkv_rope_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [(H + 2 H_KV) * 2 * HALF, K], the norm weight folded in (fold_norm_weight)
    cos_ptr,  # [M, 2 * HALF]
    sin_ptr,  # [M, 2 * HALF]
    slots_ptr,  # [M]
    q_out_ptr,  # [M, H, 2 * HALF] contiguous
    kp_ptr,  # [P, S, H_KV, 2 * HALF]
    vp_ptr,  # [P, S, H_KV, 2 * HALF]
    M, K, N_W, stride_x, stride_w, stride_c, stride_s, eps,
    stride_kpp, stride_kps, stride_kph, stride_vpp, stride_vps, stride_vph,
    H: tl.constexpr, H_KV: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    PAIR_TILES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_ROW: tl.constexpr, LINES: tl.constexpr,
    LINE_ELEMS: tl.constexpr, UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr,
    USE_GDC: tl.constexpr,
):  # fmt: skip
    head = tl.program_id(0) // PAIR_TILES  # 0..H-1: q, H..H+H_KV-1: k, then v
    d = tl.program_id(0) % PAIR_TILES * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P] pairs
    d_ok = d < HALF
    row_lo = head * 2 * HALF + (tl.program_id(0) % PAIR_TILES) * BLOCK_P  # W rows of y1
    if USE_GDC:  # the weights depend on no kernel: fetch them while the previous one drains
        _prefetch_tile_l2(w_ptr, row_lo, N_W, stride_w, K, BLOCK_P, LINES, LINE_ELEMS)
        _prefetch_tile_l2(w_ptr, row_lo + HALF, N_W, stride_w, K, BLOCK_P, LINES, LINE_ELEMS)
    gdc_sync(USE_GDC)  # x comes from the previous layer's last kernel (kernels/pdl.py)

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # RMSNorm's per-row scale from one load of whole rows, as _norm_linear_kernel.
    x = _load_rows(x_ptr, rows, row_ok, stride_x, tl.arange(0, BLOCK_ROW), K, False)
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)[:, None]  # [BLOCK_M, 1]
    w_rows = head * 2 * HALF + d  # [BLOCK_P], the partners are HALF rows further
    acc1 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_P], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _load_rows(x_ptr, rows, row_ok, stride_x, k, K, UPCAST)  # [BLOCK_M, BLOCK_K]
        w = _load_rows(w_ptr, w_rows, d_ok, stride_w, k, K, UPCAST)  # [BLOCK_P, BLOCK_K]
        acc1 += dot_nt(a, w, DOT_IEEE)
        w = _load_rows(w_ptr, w_rows + HALF, d_ok, stride_w, k, K, UPCAST)
        acc2 += dot_nt(a, w, DOT_IEEE)
    oty = q_out_ptr.dtype.element_ty
    y1 = (acc1 * inv).to(oty).to(tl.float32)  # the projection, rounded as F.linear's output
    y2 = (acc2 * inv).to(oty).to(tl.float32)

    mask = row_ok[:, None] & d_ok[None, :]  # [BLOCK_M, BLOCK_P]
    c_off = rows[:, None].to(tl.int64) * stride_c + d[None, :]
    s_off = rows[:, None].to(tl.int64) * stride_s + d[None, :]
    c1 = tl.load(cos_ptr + c_off, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + c_off + HALF, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + s_off, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + s_off + HALF, mask=mask, other=0.0).to(tl.float32)
    rotate = head < H + H_KV  # q and k heads; v heads go to the cache as they are
    r1 = tl.where(rotate, y1 * c1 - y2 * s1, y1)
    r2 = tl.where(rotate, y2 * c2 + y1 * s2, y2)
    if head < H:
        dst = q_out_ptr + (rows[:, None].to(tl.int64) * H + head) * (2 * HALF) + d[None, :]
        tl.store(dst, r1.to(oty), mask=mask)
        tl.store(dst + HALF, r2.to(oty), mask=mask)
    else:
        slot = tl.load(slots_ptr + rows, mask=row_ok, other=0).to(tl.int64)  # [BLOCK_M]
        page, off = slot // PAGE, slot % PAGE
        if head < H + H_KV:
            dst = kp_ptr + page * stride_kpp + off * stride_kps + (head - H) * stride_kph
        else:
            dst = vp_ptr + page * stride_vpp + off * stride_vps + (head - H - H_KV) * stride_vph
        dst = dst[:, None] + d[None, :]
        cty = kp_ptr.dtype.element_ty
        tl.store(dst, r1.to(cty), mask=mask)
        tl.store(dst + HALF, r2.to(cty), mask=mask)


def norm_qkv_rope_triton(
    x: torch.Tensor,  # [N, K], N <= MAX_M, K <= MAX_K
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [(H + 2 H_KV) Dh, K], rows q | k | v
    cos: torch.Tensor,  # [N, 1, Dh] (or [N, Dh])
    sin: torch.Tensor,  # [N, 1, Dh] (or [N, Dh])
    k_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    v_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    slots: torch.Tensor,  # [N] flat slots (not range-checked: no device sync)
    n_heads: int,
    n_kv_heads: int,
) -> torch.Tensor:  # rotated q [N, H, Dh], x's dtype
    """Same contract as norm_qkv_rope_ref, for inputs that `fits`, cos / sin in x's dtype
    (the model's rope_cos_sin) and pages contiguous in the head dim."""
    _check(x, weight)
    _check_qkv(weight, n_heads, n_kv_heads)
    n, k = x.shape
    head_dim = weight.shape[0] // (n_heads + 2 * n_kv_heads)
    q_out = torch.empty((n, n_heads, head_dim), device=x.device, dtype=x.dtype)
    kv_like = q_out[:, :n_kv_heads]  # [N, H_KV, Dh]: the shape rope's checks want for k, v
    check_rope_inputs(q_out, kv_like, kv_like, cos, sin, k_pages, v_pages, slots)
    if not fits(x, weight) or norm_weight.shape != (k,):
        raise ValueError(f"norm_qkv_rope_triton takes M <= {MAX_M}, K <= {MAX_K} with unit "
                         f"stride along K and a [K] norm weight; got x {tuple(x.shape)} "
                         f"stride {x.stride()}")  # fmt: skip
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        raise ValueError("k_pages / v_pages must be contiguous in the head dim")
    if n == 0:
        return q_out
    cos, sin = cos.reshape(n, head_dim).contiguous(), sin.reshape(n, head_dim).contiguous()
    half = head_dim // 2
    pair_tiles = -(-half // BLOCK_P)
    meta = _tile_meta(weight, k, None)  # BLOCK_K, warps, stages of the plain linear
    meta.pop("BLOCK_N")  # BLOCK_P pairs instead
    folded = fold_norm_weight(weight, norm_weight)
    grid = ((n_heads + 2 * n_kv_heads) * pair_tiles, triton.cdiv(n, BLOCK_M))
    _norm_qkv_rope_kernel[grid](
        x, folded, cos, sin, slots.contiguous(), q_out, k_pages, v_pages,
        n, k, folded.shape[0], x.stride(0), folded.stride(0), cos.stride(0), sin.stride(0),
        float(eps),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        H=n_heads, H_KV=n_kv_heads, HALF=half, PAGE=k_pages.shape[1], PAIR_TILES=pair_tiles,
        BLOCK_P=BLOCK_P, BLOCK_ROW=max(16, next_pow2(k)), **meta, **_precision(x),
        **pdl_launch(x.device),
    )  # fmt: skip
    return q_out
