"""Linear layers of few rows fused with their neighbours: RMSNorm before (+ SwiGLU after), or
the residual add after. Torch references and Triton kernels with one contract.

Why: a verify step runs every linear layer on M = B * Q rows (16 for one request's block).
On the H200 the cuBLAS GEMMs of the default model took ~3.7 us each at M = 16 for 0.3-1.8 MB
of weights (latency-bound), and the RMSNorm and SwiGLU around them were launches of their
own (~1.6 us each): 210 of a step's ~330 kernels. Here a layer's four linears are four
kernels and the norms and the activation ride inside them.

Kernel shape: one program owns BLOCK_N output columns of BLOCK_M rows over the WHOLE K extent
in one tile (BLOCK_K = next_pow2(K) <= MAX_K), so a row's RMSNorm statistics are in the
program and the product is one tl.dot. The weight tile is loaded first: it depends on no
earlier kernel, so under programmatic dependent launch (kernels/pdl.py) its read overlaps
the previous kernel's tail. Rows past BLOCK_M take more programs along grid axis 1; callers
use these kernels for small M only (`fits`), large M goes to cuBLAS.

Roundings follow the model code (target.RMSNorm, F.linear, MLP, the residual add): the
normalised row is rounded to x's dtype before the norm weight, that product rounded again;
the GEMM accumulates in fp32 and rounds once; silu is rounded before the product with up;
the residual add rounds the projection first, then the sum. Summation order inside the GEMM
differs from cuBLAS, so results match to rounding, not bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitflash.kernels.fused_norm import rms_norm_ref
from splitflash.kernels.pdl import gdc_sync, pdl_launch
from splitflash.kernels.silu_mul import silu_mul_ref
from splitflash.kernels.tuning import interpreter_active, next_pow2

MAX_M = 64  # rows these kernels take; more rows amortise a cuBLAS launch anyway
MAX_K = 2048  # a [BLOCK_N, K] weight tile plus [BLOCK_M, K] rows must fit in registers
BLOCK_M = 16  # the smallest tl.dot tile; a 16-token block is one row tile


def _check(x: torch.Tensor, weight: torch.Tensor, out_cols: int | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if out_cols is not None and weight.shape[0] != 2 * out_cols:
        raise ValueError(f"SwiGLU weight must be [2 * {out_cols}, K], got {tuple(weight.shape)}")


def fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Do these kernels take this product (few rows, K in one tile, unit stride along K)?"""
    return (
        x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and x.shape[1] <= MAX_K
        and x.stride(1) == 1 and weight.stride(1) == 1
    )  # fmt: skip


# --- references: the model's own op sequence --------------------------------------------


def norm_linear_ref(
    x: torch.Tensor,  # [M, K]
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]; SwiGLU: [2I, K] (gate rows, then up rows)
    swiglu_hidden: int | None = None,  # I: return silu(gate) * up [M, I]
) -> torch.Tensor:  # [M, N] or [M, I]
    _check(x, weight, swiglu_hidden)
    y = F.linear(rms_norm_ref(x, norm_weight, eps), weight)
    return y if swiglu_hidden is None else silu_mul_ref(y, swiglu_hidden)


def linear_residual_ref(
    a: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N]
) -> torch.Tensor:  # residual + a @ weight.T, [M, N]
    _check(a, weight)
    return residual + F.linear(a, weight)


# --- kernels ------------------------------------------------------------------------------


@triton.jit
def _dot_t(a, w, DOT_IEEE: tl.constexpr):
    """a [M, K] @ w[N, K].T in fp32; fp32 operands (DOT_IEEE) without tf32 rounding."""
    if DOT_IEEE:  # noqa: SIM108 - constexpr branch, one side is compiled
        acc = tl.dot(a, tl.trans(w), input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w))
    return acc


@triton.jit
def _weight_tile(w_ptr, row0, n_rows, stride_w, K, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """Rows row0 + [0, BLOCK_N) (< n_rows) of w, all K columns: [BLOCK_N, BLOCK_K]."""
    rows = row0 + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    mask = (rows < n_rows)[:, None] & (k < K)[None, :]
    w = tl.load(w_ptr + rows[:, None].to(tl.int64) * stride_w + k[None, :], mask=mask, other=0.0)
    return w.to(tl.float32) if UPCAST else w


@triton.jit
def _norm_linear_kernel(
    x_ptr,  # [M, K]
    nw_ptr,  # [K] norm weight
    w_ptr,  # [N_W, K]: N_W = N, or 2 * N for SwiGLU (gate rows, then up rows)
    out_ptr,  # [M, N] contiguous
    M, N, K, stride_x, stride_w, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWIGLU: tl.constexpr, UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    w = _weight_tile(w_ptr, n0, N, stride_w, K, BLOCK_N, BLOCK_K, UPCAST)
    if SWIGLU:
        w_up = _weight_tile(w_ptr + N * stride_w, n0, N, stride_w, K, BLOCK_N, BLOCK_K, UPCAST)
    k = tl.arange(0, BLOCK_K)
    nw = tl.load(nw_ptr + k, mask=k < K, other=0.0).to(tl.float32)
    gdc_sync(USE_GDC)  # everything above reads weights only (kernels/pdl.py)

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + k[None, :],
                mask=row_ok[:, None] & (k < K)[None, :], other=0.0)  # fmt: skip
    xty = x.dtype
    x = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, axis=1) / K + eps)  # [BLOCK_M]; padding lanes add zeros
    a = (x * inv[:, None]).to(xty).to(tl.float32)  # rounded before the weight (RMSNorm)
    a = (nw[None, :] * a).to(xty)  # [BLOCK_M, BLOCK_K], the normed rows in x's dtype
    if UPCAST:
        a = a.to(tl.float32)
    acc = _dot_t(a, w, DOT_IEEE)  # [BLOCK_M, BLOCK_N] fp32
    oty = out_ptr.dtype.element_ty
    if SWIGLU:
        g = acc.to(oty).to(tl.float32)
        u = _dot_t(a, w_up, DOT_IEEE).to(oty).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(oty).to(tl.float32)  # F.silu rounds
        acc = s * u
    cols = n0 + tl.arange(0, BLOCK_N)
    dst = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(dst, acc.to(oty), mask=row_ok[:, None] & (cols < N)[None, :])


@triton.jit
def _linear_residual_kernel(
    a_ptr,  # [M, K]
    w_ptr,  # [N, K]
    res_ptr,  # [M, N]
    out_ptr,  # [M, N] contiguous
    M, N, K, stride_a, stride_w, stride_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr, USE_GDC: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    w = _weight_tile(w_ptr, n0, N, stride_w, K, BLOCK_N, BLOCK_K, UPCAST)
    gdc_sync(USE_GDC)  # everything above reads weights only (kernels/pdl.py)

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    k = tl.arange(0, BLOCK_K)
    a = tl.load(a_ptr + rows[:, None].to(tl.int64) * stride_a + k[None, :],
                mask=row_ok[:, None] & (k < K)[None, :], other=0.0)  # fmt: skip
    if UPCAST:
        a = a.to(tl.float32)
    acc = _dot_t(a, w, DOT_IEEE)  # [BLOCK_M, BLOCK_N] fp32
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    r = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    oty = out_ptr.dtype.element_ty
    y = r + acc.to(oty).to(tl.float32)  # the projection is rounded before the add
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(oty), mask=mask)


def _launch_shape(n_cols: int, k: int, tiles: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): narrow column tiles so even a 576-column layer spreads
    over ~36 SMs (the work is latency, not bandwidth); 8 warps hold the [*, K] tiles in
    registers at K 1024-2048. tiles: weight tiles per program (2 with SwiGLU)."""
    block_k = max(16, next_pow2(k))
    block_n = 16 if n_cols <= 4096 else 32
    warps = 4 if block_k * tiles <= 1024 else 8
    return block_n, block_k, warps


def _precision(x: torch.Tensor) -> dict:
    upcast = interpreter_active() or x.dtype == torch.float32
    return dict(UPCAST=upcast, DOT_IEEE=upcast)


def norm_linear_triton(
    x: torch.Tensor,  # [M, K], M <= MAX_M, K <= MAX_K
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]; SwiGLU: [2I, K]
    swiglu_hidden: int | None = None,
) -> torch.Tensor:  # [M, N] or [M, I], x's dtype
    """Same contract as norm_linear_ref, for inputs that `fits`."""
    _check(x, weight, swiglu_hidden)
    if not fits(x, weight) or norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_linear_triton takes M <= {MAX_M}, K <= {MAX_K} with unit "
                         f"stride along K; got x {tuple(x.shape)} stride {x.stride()}")  # fmt: skip
    m, k = x.shape
    n = weight.shape[0] if swiglu_hidden is None else swiglu_hidden
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    block_n, block_k, warps = _launch_shape(n, k, 1 if swiglu_hidden is None else 2)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, BLOCK_M))
    _norm_linear_kernel[grid](
        x, norm_weight.contiguous(), weight, out, m, n, k, x.stride(0), weight.stride(0),
        float(eps), BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        SWIGLU=swiglu_hidden is not None, num_warps=warps, **_precision(x),
        **pdl_launch(x.device),
    )  # fmt: skip
    return out


def linear_residual_triton(
    a: torch.Tensor,  # [M, K], M <= MAX_M, K <= MAX_K
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N], a's dtype
) -> torch.Tensor:  # residual + a @ weight.T, [M, N]
    """Same contract as linear_residual_ref, for inputs that `fits`."""
    _check(a, weight)
    m, k = a.shape
    n = weight.shape[0]
    if not fits(a, weight) or residual.shape != (m, n) or residual.stride(1) != 1:
        raise ValueError(f"linear_residual_triton takes M <= {MAX_M}, K <= {MAX_K}, unit "
                         f"strides and residual [M, N]; got a {tuple(a.shape)}, weight "
                         f"{tuple(weight.shape)}, residual {tuple(residual.shape)}")  # fmt: skip
    out = torch.empty((m, n), device=a.device, dtype=residual.dtype)
    block_n, block_k, warps = _launch_shape(n, k, 1)
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, BLOCK_M))
    _linear_residual_kernel[grid](
        a, weight, residual, out, m, n, k, a.stride(0), weight.stride(0), residual.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps,
        **_precision(a), **pdl_launch(a.device),
    )  # fmt: skip
    return out
