"""Per-head RMSNorm then RoPE in one kernel: the drafter's q_norm / k_norm + apply_rope.

Why: in the DFlash drafter (Qwen3-style layers) every q and k is normalised per head and
rotated: as torch ops that is 8 elementwise launches for the norm and 5 for the rotation,
twice a layer and once more per layer for the context rows' keys: ~100 of a draft step's
launches. One launch here per tensor.

Roundings follow the module sequence (models/dflash/layers.py) op for op: the norm in fp32
rounded to x's dtype, times the weight (rounded), then x * cos and rotate_half(x) * sin each
rounded before their rounded sum. The fp32 mean of squares sums in another order than torch,
so outputs match the references to rounding (the tests hold them to the fp64 rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.fused_norm import rms_norm_ref
from splitflash.kernels.tuning import next_pow2


def rotate_half_rope_ref(
    x: torch.Tensor,  # [..., M, H, hd]
    cos: torch.Tensor,  # [..., M, hd], broadcast over the heads
    sin: torch.Tensor,  # [..., M, hd]
) -> torch.Tensor:  # [..., M, H, hd]
    """HF's rotate-half RoPE, x * cos + rotate_half(x) * sin; the drafter's apply_rope
    (models/dflash/layers.py) is this function."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(-2) + rotated * sin.unsqueeze(-2)


def head_norm_rope_ref(
    x: torch.Tensor,  # [M, H, hd], unit stride along hd
    weight: torch.Tensor,  # [hd]
    eps: float,
    cos: torch.Tensor,  # [M, hd], x's dtype
    sin: torch.Tensor,  # [M, hd]
) -> torch.Tensor:  # [M, H, hd]
    _check(x, weight, cos, sin)
    return rotate_half_rope_ref(rms_norm_ref(x, weight, eps), cos, sin)


def _check(x, weight, cos, sin) -> None:
    if x.dim() != 3 or x.shape[-1] % 2 or weight.shape != (x.shape[-1],):
        raise ValueError(f"x must be [M, H, hd] with an even hd and weight [hd], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")  # fmt: skip
    want = (x.shape[0], x.shape[-1])
    if cos.shape != want or sin.shape != want:
        raise ValueError(f"cos and sin must be [M, hd] = {list(want)}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")  # fmt: skip


@triton.jit
def _head_norm_rope_kernel(
    x_ptr,  # [M, H, hd], strides (stride_xm, stride_xh, 1)
    w_ptr,  # [hd]
    cos_ptr, sin_ptr,  # [M, hd], row strides stride_c / stride_s
    out_ptr,  # [M, H, hd] contiguous
    H, stride_xm, stride_xh, stride_c, stride_s, eps,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
):  # fmt: skip
    """One program per row: its H heads as [BLOCK_H, BLOCK_HALF] tiles of each half."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (heads < H)[:, None] & (d < HALF)[None, :]
    src = x_ptr + row * stride_xm + heads[:, None] * stride_xh + d[None, :]
    # fp32 right after every load (the interpreter's bf16 is broken).
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)
    dty = x_ptr.dtype.element_ty
    d_ok = d < HALF
    w1 = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # rms_norm_ref: the normalised row rounded to x's dtype, then times the weight (rounded).
    y1 = (w1 * (x1 * inv[:, None]).to(dty).to(tl.float32)).to(dty).to(tl.float32)
    y2 = (w2 * (x2 * inv[:, None]).to(dty).to(tl.float32)).to(dty).to(tl.float32)
    c1 = tl.load(cos_ptr + row * stride_c + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cos_ptr + row * stride_c + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sin_ptr + row * stride_s + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + row * stride_s + HALF + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product rounded first.
    o1 = (y1 * c1).to(dty).to(tl.float32) + (-y2 * s1).to(dty).to(tl.float32)
    o2 = (y2 * c2).to(dty).to(tl.float32) + (y1 * s2).to(dty).to(tl.float32)
    dst = out_ptr + row * H * (2 * HALF) + heads[:, None] * (2 * HALF) + d[None, :]
    tl.store(dst, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)


def head_norm_rope_triton(
    x: torch.Tensor,  # [M, H, hd], unit stride along hd (a slice of a qkv output is fine)
    weight: torch.Tensor,  # [hd], x's dtype
    eps: float,
    cos: torch.Tensor,  # [M, hd], x's dtype, unit stride along hd
    sin: torch.Tensor,  # [M, hd]
) -> torch.Tensor:  # [M, H, hd] contiguous, x's dtype
    """Same contract as head_norm_rope_ref (weight in x's dtype, as the drafter keeps it)."""
    _check(x, weight, cos, sin)
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("head_norm_rope_triton needs unit stride along hd (x, cos, sin)")
    m, h, hd = x.shape
    out = torch.empty((m, h, hd), device=x.device, dtype=x.dtype)
    if m:
        _head_norm_rope_kernel[(m,)](
            x, weight.contiguous(), cos, sin, out, h, x.stride(0), x.stride(1), cos.stride(0),
            sin.stride(0), float(eps), HALF=hd // 2, BLOCK_H=max(2, next_pow2(h)),
            BLOCK_HALF=max(16, next_pow2(hd // 2)), num_warps=4 if h * hd > 1024 else 2,
        )  # fmt: skip
    return out
