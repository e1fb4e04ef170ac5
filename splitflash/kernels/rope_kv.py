"""RoPE on q and k fused with the paged KV-cache write: torch reference and Triton kernel with
one contract.

Semantics are those of `splitflash.models.target.apply_rope` (HF rotate-half layout, cos/sin
from `rope_cos_sin`) on q and k, followed by `PagedKVCache.write` of the rotated k and the raw
v at flat slots (slot = page * S + offset). The unfused path is ~8 small kernels (two
rotate-half cats, four multiplies, two adds) plus two index_put writes; this is one pass.

The kernel computes in fp32 and rounds once, where the low-precision torch path rounds after
every multiply and add; that is at least as close to the exact result, never bit-identical.

Grid: (N, H_KV). One program owns one token and one KV head: it rotates that head's k, writes
k and v into the cache slot, and rotates the G = H / H_KV query heads sharing it, so cos/sin
of the token are loaded once per program and every program moves the same bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.pdl import gdc_sync, pdl_launch
from splitflash.kernels.tuning import next_pow2


def check_rope_inputs(q, k, v, cos, sin, k_pages, v_pages, slots) -> int:
    """Shape checks (no device sync). Returns the GQA group size G = H // H_KV."""
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            "q must be [N, H, Dh] and k, v [N, H_KV, Dh], got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, n_heads, head_dim = q.shape
    if k.shape[0] != n or k.shape[2] != head_dim or head_dim % 2:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)} (even Dh needed)")
    if n_heads % k.shape[1]:
        raise ValueError(f"H={n_heads} is not a multiple of H_KV={k.shape[1]}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape not in ((n, 1, head_dim), (n, head_dim)):
            raise ValueError(f"{name} must be [N, 1, Dh] = {(n, 1, head_dim)}, got {t.shape}")
    if k_pages.dim() != 4 or v_pages.shape != k_pages.shape or k_pages.shape[2:] != k.shape[1:]:
        raise ValueError(
            f"k_pages / v_pages must be [P, S, H_KV={k.shape[1]}, Dh={head_dim}], got "
            f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
        )
    if slots.shape != (n,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slots must be an integer [N={n}] tensor, got {slots.dtype} {slots.shape}"
        )
    return n_heads // k.shape[1]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # target.apply_rope, op for op (the tests hold the two to bit equality).
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_kv_write_ref(
    q: torch.Tensor,  # [N, H, Dh]
    k: torch.Tensor,  # [N, H_KV, Dh]
    v: torch.Tensor,  # [N, H_KV, Dh]
    cos: torch.Tensor,  # [N, 1, Dh] (or [N, Dh])
    sin: torch.Tensor,  # [N, 1, Dh] (or [N, Dh])
    k_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    v_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    slots: torch.Tensor,  # [N] flat slots, page * S + offset
) -> torch.Tensor:  # rotated q [N, H, Dh]
    check_rope_inputs(q, k, v, cos, sin, k_pages, v_pages, slots)
    n, _, head_dim = q.shape
    cos, sin = cos.reshape(n, 1, head_dim), sin.reshape(n, 1, head_dim)
    # (page, slot) indexing writes in place through any page layout (the cache's pages are
    # head-major views); flattening a strided view would write into a copy.
    page, slot = slots // k_pages.shape[1], slots % k_pages.shape[1]
    k_pages[page, slot] = _rotate(k, cos, sin).to(k_pages.dtype)
    v_pages[page, slot] = v.to(v_pages.dtype)
    return _rotate(q, cos, sin)


@triton.jit
def _rope_kv_kernel(
    q_ptr,  # [N, H, Dh]
    k_ptr,  # [N, H_KV, Dh]
    v_ptr,  # [N, H_KV, Dh]
    cos_ptr,  # [N, Dh]
    sin_ptr,  # [N, Dh]
    kp_ptr,  # [P, S, H_KV, Dh]
    vp_ptr,  # [P, S, H_KV, Dh]
    slots_ptr,  # [N]
    qo_ptr,  # [N, H, Dh] contiguous
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cn, stride_sn,
    stride_kpp, stride_kps, stride_kph, stride_vpp, stride_vps, stride_vph,
    H: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    gdc_sync(USE_GDC)  # q, k, v come from the qkv projection just before (kernels/pdl.py)
    n = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)  # [BLOCK_HALF], one rotate-half pair per lane
    d_ok = d < HALF
    # Both halves of cos/sin are loaded: the kernel does not rely on rope_cos_sin's
    # duplicated frequencies. fp32 right after every load (the interpreter's bf16 is broken).
    c1 = tl.load(cos_ptr + n * stride_cn + d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + n * stride_cn + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + n * stride_sn + d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + n * stride_sn + HALF + d, mask=d_ok, other=0.0).to(tl.float32)

    # k: rotate, then straight into its cache slot with v (no intermediate tensor).
    slot = tl.load(slots_ptr + n).to(tl.int64)
    k_src = k_ptr + n * stride_kn + kv_head * stride_kh + d
    k1 = tl.load(k_src, mask=d_ok, other=0.0).to(tl.float32)
    k2 = tl.load(k_src + HALF, mask=d_ok, other=0.0).to(tl.float32)
    k_dst = kp_ptr + (slot // PAGE) * stride_kpp + (slot % PAGE) * stride_kps
    k_dst += kv_head * stride_kph + d
    kty = kp_ptr.dtype.element_ty
    tl.store(k_dst, (k1 * c1 - k2 * s1).to(kty), mask=d_ok)
    tl.store(k_dst + HALF, (k2 * c2 + k1 * s2).to(kty), mask=d_ok)
    v_src = v_ptr + n * stride_vn + kv_head * stride_vh + d
    v_dst = vp_ptr + (slot // PAGE) * stride_vpp + (slot % PAGE) * stride_vps
    v_dst += kv_head * stride_vph + d
    vty = vp_ptr.dtype.element_ty
    tl.store(v_dst, tl.load(v_src, mask=d_ok, other=0.0).to(vty), mask=d_ok)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=d_ok, other=0.0).to(vty), mask=d_ok)

    # q: the G heads sharing this KV head, as one [BLOCK_G, BLOCK_HALF] tile per half.
    g = tl.arange(0, BLOCK_G)
    head = kv_head * G + g  # [BLOCK_G]
    mask = (g < G)[:, None] & d_ok[None, :]
    q_src = q_ptr + n * stride_qn + head[:, None] * stride_qh + d[None, :]
    q1 = tl.load(q_src, mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_src + HALF, mask=mask, other=0.0).to(tl.float32)
    q_dst = qo_ptr + (n * H + head[:, None]) * (2 * HALF) + d[None, :]
    qty = qo_ptr.dtype.element_ty
    tl.store(q_dst, (q1 * c1[None, :] - q2 * s1[None, :]).to(qty), mask=mask)
    tl.store(q_dst + HALF, (q2 * c2[None, :] + q1 * s2[None, :]).to(qty), mask=mask)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    # The kernel addresses the last dim with unit stride; any other stride is rare (copy).
    return t if t.stride(-1) == 1 else t.contiguous()


def rope_kv_write_triton(
    q: torch.Tensor,  # [N, H, Dh], any row / head strides (views of the fused qkv output)
    k: torch.Tensor,  # [N, H_KV, Dh]
    v: torch.Tensor,  # [N, H_KV, Dh]
    cos: torch.Tensor,  # [N, 1, Dh] (or [N, Dh])
    sin: torch.Tensor,  # [N, 1, Dh] (or [N, Dh])
    k_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    v_pages: torch.Tensor,  # [P, S, H_KV, Dh], written in place
    slots: torch.Tensor,  # [N] flat slots, page * S + offset
) -> torch.Tensor:  # rotated q [N, H, Dh], contiguous
    """Same contract as rope_kv_write_ref. Slots are not range-checked (that would need a
    device->host sync); out-of-range slots are the caller's bug, as with any index."""
    group = check_rope_inputs(q, k, v, cos, sin, k_pages, v_pages, slots)
    if k_pages.stride(3) != 1 or v_pages.stride(3) != 1:
        raise ValueError("k_pages / v_pages must be contiguous in the head dim")
    n, n_heads, head_dim = q.shape
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    cos = _unit_last(cos.reshape(n, head_dim))
    sin = _unit_last(sin.reshape(n, head_dim))
    # Result dtype of q * cos + rotated * sin under torch promotion.
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, cos.dtype), sin.dtype)
    q_out = torch.empty(q.shape, device=q.device, dtype=out_dtype)
    if n == 0:
        return q_out
    half = head_dim // 2
    n_kv_heads = k.shape[1]
    _rope_kv_kernel[(n, n_kv_heads)](
        q, k, v, cos, sin, k_pages, v_pages, slots.contiguous(), q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        v_pages.stride(0), v_pages.stride(1), v_pages.stride(2),
        H=n_heads, G=group, HALF=half, PAGE=k_pages.shape[1],
        BLOCK_G=next_pow2(group), BLOCK_HALF=max(16, next_pow2(half)),
        # Per program: G + 2 heads of Dh elements (~2.5 KiB at G=4, Dh=128 in bf16); more
        # warps would idle. A memory-bound pass: unmeasured, no autotuning.
        num_warps=4 if group * half >= 512 else 2, **pdl_launch(q.device),
    )  # fmt: skip
    return q_out
