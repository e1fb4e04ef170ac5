"""RMSNorm, optionally fused with the residual add of a decoder layer: torch reference and
Triton kernel with one contract.

Semantics are exactly those of `splitflash.models.target.RMSNorm.forward`: statistics in fp32,
the normalised row rounded to x.dtype BEFORE the weight multiply, and the result dtype that
torch promotion gives `weight * x` (x.dtype when the weight has x's dtype). With a residual,
h = x + residual is rounded to x.dtype first (what `x + residual` does in torch) and both the
norm of h and h itself come back, so the layer reads its hidden state once instead of twice.

The kernel is memory-bound: one program owns ROWS whole rows (BLOCK_D = next_pow2(D) >= D, so
a row is one masked tile and the reduction never loops); ROWS > 1 only for short rows (the
per-head q/k norm) so that each program still moves a few KiB.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.tuning import next_pow2

_TILE_ELEMS = 2048  # elements per program when rows are short: ~4-8 KiB in bf16 / fp32


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, x.dtype)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        raise ValueError(f"weight must be [D={x.shape[-1]}], got {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"residual must match x ({x.dtype} {tuple(x.shape)}), "
            f"got {residual.dtype} {tuple(residual.shape)}"
        )


def rms_norm_ref(
    x: torch.Tensor,  # [..., D] (normally [N, D])
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D], x's dtype
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """weight * rmsnorm(x); with a residual, (weight * rmsnorm(x + residual), x + residual)."""
    _check(x, weight, residual)
    h = x if residual is None else x + residual
    hf = h.float()
    # Same op sequence as target.RMSNorm, so the CPU path is bit-identical to the model.
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * hf.to(h.dtype)
    return out if residual is None else (out, h)


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [M, D]
    res_ptr,  # [M, D] (read when HAS_RES)
    w_ptr,  # [D]
    out_ptr,  # [M, D] contiguous
    h_ptr,  # [M, D] contiguous (written when HAS_RES)
    n_rows, stride_x, stride_r, eps,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RES: tl.constexpr,
):  # fmt: skip
    # int64 row offsets: M * D can pass 2**31 for long prefills at large hidden sizes.
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
    offs = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (rows < n_rows)[:, None] & (offs < D)[None, :]
    # fp32 right after every load: all math is fp32, and the interpreter's bf16 is broken.
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    dst = rows[:, None] * D + offs[None, :]
    if HAS_RES:
        r = tl.load(res_ptr + rows[:, None] * stride_r + offs[None, :], mask=mask, other=0.0)
        # Round the sum to x's dtype before using it, as torch's `x + residual` does.
        h = (x + r.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + dst, h, mask=mask)
        x = h.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)  # [ROWS]; padding lanes add zeros
    # The normalised row is rounded to the input dtype before the weight (target.RMSNorm).
    y = (x * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
    tl.store(out_ptr + dst, (w[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)


def _launch_shape(d: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) for rows of length d."""
    block_d = max(16, next_pow2(d))
    rows = max(1, _TILE_ELEMS // block_d)
    # 4 warps hold up to 4096 fp32 lanes in ~32 registers per tensor per thread; wider rows
    # (hidden 8192+) get more warps rather than spilling. Unmeasured beyond 4 warps.
    warps = 4 if block_d <= 4096 else 8 if block_d <= 16384 else 16
    return block_d, rows, warps


def rms_norm_triton(
    x: torch.Tensor,  # [..., D]
    weight: torch.Tensor,  # [D]
    eps: float,
    residual: torch.Tensor | None = None,  # [..., D], x's dtype
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rms_norm_ref; outputs are new contiguous tensors."""
    _check(x, weight, residual)
    d = x.shape[-1]
    # reshape is a view for the usual layouts (a [N, H, Dh] slice of the fused qkv output
    # included); the kernel only needs unit stride along D.
    x2 = x.reshape(-1, d)
    x2 = x2 if x2.stride(1) == 1 else x2.contiguous()
    out = torch.empty(x.shape, device=x.device, dtype=_out_dtype(x, weight))
    h = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else out
    res2 = x2
    if residual is not None:
        res2 = residual.reshape(-1, d)
        res2 = res2 if res2.stride(1) == 1 else res2.contiguous()
    n_rows = x2.shape[0]
    if n_rows > 0:
        block_d, rows, warps = _launch_shape(d)
        _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
            x2, res2, weight.contiguous(), out, h, n_rows, x2.stride(0), res2.stride(0),
            float(eps), D=d, ROWS=rows, BLOCK_D=block_d, HAS_RES=residual is not None,
            num_warps=warps,
        )  # fmt: skip
    return out if residual is None else (out, h)
