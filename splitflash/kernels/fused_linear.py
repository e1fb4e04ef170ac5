"""Linear layers of few rows fused with their neighbours: RMSNorm before (+ SwiGLU after), or
the residual add after: the Triton kernels of the contract in kernels/fused_linear_ref.py.

Why: a verify step runs every linear layer on M = B * Q rows (16 for one request's block).
On the H200 the cuBLAS GEMMs of the default model took ~3.7 us each at M = 16 for 0.3-1.8 MB
of weights (latency-bound), and the RMSNorm and SwiGLU around them were launches of their
own (~1.6 us each), as were the residual adds: 270 of a step's ~390 kernels. Here a layer's
four linears are four kernels, with the norms, the activation and the adds inside them.

Kernel shape: one program owns BLOCK_N output columns of BLOCK_M rows and walks all of K in
BLOCK_K steps, or one of SPLIT_K slices of K on launches with too few tiles to fill the GPU
(kernels/split_k.py: the tile's last program sums the slices and runs the epilogue).
RMSNorm is a per-row scale once its weight is folded into the linear weight
(`fold_norm_weight`, computed once and cached): the loop is a plain GEMM of x and W * nw,
the row's rsqrt(mean(x^2) + eps) (from one load of whole rows) scales the result. Under
programmatic dependent launch (kernels/pdl.py) the program first asks L2 for its whole
weight tile (no kernel writes weights), then waits for the previous kernel: the weight
read overlaps that kernel's tail. Rows past BLOCK_M take more programs along grid axis 1;
callers use these kernels for small M only (`fits`), large M goes to cuBLAS.

Roundings: the GEMM accumulates in fp32 and rounds its output once (as F.linear); silu is
rounded before the product with up (as MLP); the residual add rounds the projection, then
the sum (as `x + proj(a)`). The norm differs from target.RMSNorm in one place: W * nw is
rounded once to the weights' dtype, where the model rounds x * rsqrt(...) and then its
product with nw; and the summation order differs from cuBLAS. Results therefore
match the model to rounding, not bit for bit (the tests hold them to the fp64 rule).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitflash.kernels.fused_linear_ref import MAX_K, check_linear, fits, fold_norm_weight
from splitflash.kernels.linear_tiles import (
    BLOCK_M,
    INVARIANT_NORM_CHUNK,
    LinearConfig,
    LinearLaunch,
    plan_launch,
)
from splitflash.kernels.online_softmax import dot_nt
from splitflash.kernels.pdl import gdc_sync, pdl_launch, prefetch_l2
from splitflash.kernels.split_k import (
    arrival_counters,
    arrive,
    store_partial,
    sum_partials,
    workspace,
)
from splitflash.kernels.tuning import interpreter_active, next_pow2

# --- kernels ------------------------------------------------------------------------------


@triton.jit
def _prefetch_tile_l2(w_ptr, row0, n_rows, stride_w, k_lo, k_hi, BLOCK_N: tl.constexpr,
                      LINES: tl.constexpr, LINE_ELEMS: tl.constexpr):  # fmt: skip
    """Ask L2 for rows row0 + [0, BLOCK_N) of w, columns [k_lo, k_hi): one `prefetch.global.L2`
    per 128-byte line (addresses clamped into the tile, so the padding lanes re-ask valid
    lines). No registers hold the data, so the whole tile can be requested before gdc_wait."""
    rows = tl.minimum(row0 + tl.arange(0, BLOCK_N), n_rows - 1).to(tl.int64)
    cols = tl.minimum(k_lo + tl.arange(0, LINES) * LINE_ELEMS, k_hi - 1)
    prefetch_l2(w_ptr + rows[:, None] * stride_w + cols[None, :])  # [BLOCK_N, LINES]


@triton.jit
def _load_rows(ptr, rows, row_ok, stride, k, K, UPCAST: tl.constexpr):
    """[len(rows), len(k)] of a row-major matrix, zeros outside (rows < M, k < K)."""
    mask = row_ok[:, None] & (k < K)[None, :]
    t = tl.load(ptr + rows[:, None].to(tl.int64) * stride + k[None, :], mask=mask, other=0.0)
    return t.to(tl.float32) if UPCAST else t


@triton.jit
def _norm_linear_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N_W, K] with the norm weight folded in (fold_norm_weight): N_W = N, or 2 * N
    #         for SwiGLU (gate rows, then up rows)
    out_ptr,  # [M, N] contiguous
    ws_ptr, counter_ptr,  # SPLIT_K > 1: fp32 partials [1 or 2, SPLIT_K, M, N], arrival counters
    M, N, K, K_SPLIT, stride_x, stride_w, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM_CHUNK: tl.constexpr, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
    SWIGLU: tl.constexpr, UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr, USE_GDC: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,  # NORM_CHUNK >= K: the tile's rows are loaded in one piece
    SPLIT_K: tl.constexpr,  # programs along K per tile (grid axis 2), kernels/split_k.py
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    w_up_ptr = w_ptr + N.to(tl.int64) * stride_w  # SwiGLU: the up rows
    if USE_GDC:  # the weights depend on no kernel: fetch them while the previous one drains
        _prefetch_tile_l2(w_ptr, n0, N, stride_w, k_lo, k_hi, BLOCK_N, LINES, LINE_ELEMS)
        if SWIGLU:
            _prefetch_tile_l2(w_up_ptr, n0, N, stride_w, k_lo, k_hi, BLOCK_N, LINES, LINE_ELEMS)
    gdc_sync(USE_GDC)  # kernels/pdl.py

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    # The rows' mean square is kept out of the K loop, whose operands then stream straight
    # into the MMA (a loop that built its operand in registers measured ~2x slower on the
    # H200; summing the operands' squares inside it, ~1.2x slower on an H100).
    # WHOLE_ROWS (16-row tiles, or K <= 128): the whole rows are loaded before the loop and
    # reduced after it, so the loop's first loads need not wait for that reduction (3.1 vs
    # 4.2 us a link at M 16, an H100, session 27). Wider tiles: chunk by chunk before the
    # loop, as 64 whole rows held across it would not fit in registers. Split programs each
    # take the whole rows' statistics (an L2 read of 16 rows), whichever ends up last.
    ss = tl.zeros([BLOCK_M], tl.float32)
    if WHOLE_ROWS:
        x_rows = _load_rows(x_ptr, rows, row_ok, stride_x, tl.arange(0, NORM_CHUNK), K, False)
    else:
        for c0 in range(0, K, NORM_CHUNK):
            x = _load_rows(x_ptr, rows, row_ok, stride_x, c0 + tl.arange(0, NORM_CHUNK), K, False)
            x = x.to(tl.float32)
            ss += tl.sum(x * x, axis=1)
    wrows = n0 + tl.arange(0, BLOCK_N)
    w_ok = wrows < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _load_rows(x_ptr, rows, row_ok, stride_x, k, k_hi, UPCAST)  # [BLOCK_M, BLOCK_K]
        w = _load_rows(w_ptr, wrows, w_ok, stride_w, k, k_hi, UPCAST)  # [BLOCK_N, BLOCK_K]
        acc += dot_nt(a, w, DOT_IEEE)
        if SWIGLU:
            w = _load_rows(w_up_ptr, wrows, w_ok, stride_w, k, k_hi, UPCAST)
            acc_up += dot_nt(a, w, DOT_IEEE)
    if WHOLE_ROWS:
        x_rows = x_rows.to(tl.float32)
        ss += tl.sum(x_rows * x_rows, axis=1)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    if SPLIT_K > 1:  # the tile's last program sums the partials; the others store nothing
        store_partial(ws_ptr, acc, rows, cols, mask, M, N, 0, SPLIT_K)
        if SWIGLU:
            store_partial(ws_ptr, acc_up, rows, cols, mask, M, N, 1, SPLIT_K)
        last = arrive(counter_ptr, SPLIT_K)
        mask = tl.where(last, mask, False)
        acc = sum_partials(ws_ptr, rows, cols, mask, M, N, 0, SPLIT_K, BLOCK_M, BLOCK_N)
        if SWIGLU:
            acc_up = sum_partials(ws_ptr, rows, cols, mask, M, N, 1, SPLIT_K, BLOCK_M, BLOCK_N)
    inv = tl.rsqrt(ss / K + eps)[:, None]  # [BLOCK_M, 1]
    oty = out_ptr.dtype.element_ty
    # RMSNorm is a per-row scale: x @ (W * nw).T times the row's rsqrt(mean(x^2) + eps).
    y = (acc * inv).to(oty).to(tl.float32)  # the projection, rounded as F.linear's output
    if SWIGLU:
        s = (y / (1.0 + tl.exp(-y))).to(oty).to(tl.float32)  # F.silu rounds
        y = s * (acc_up * inv).to(oty).to(tl.float32)
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(oty), mask=mask)


@triton.jit
def _linear_residual_kernel(
    a_ptr,  # [M, K]
    w_ptr,  # [N, K]
    res_ptr,  # [M, N]
    out_ptr,  # [M, N] contiguous
    ws_ptr, counter_ptr,  # SPLIT_K > 1: fp32 partials [1, SPLIT_K, M, N], arrival counters
    M, N, K, K_SPLIT, stride_a, stride_w, stride_r,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    LINES: tl.constexpr, LINE_ELEMS: tl.constexpr,
    UPCAST: tl.constexpr, DOT_IEEE: tl.constexpr, USE_GDC: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs along K per tile (grid axis 2), kernels/split_k.py
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    k_lo = tl.program_id(2) * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    if USE_GDC:  # the weights depend on no kernel: fetch them while the previous one drains
        _prefetch_tile_l2(w_ptr, n0, N, stride_w, k_lo, k_hi, BLOCK_N, LINES, LINE_ELEMS)
    gdc_sync(USE_GDC)  # kernels/pdl.py

    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    wrows = n0 + tl.arange(0, BLOCK_N)
    w_ok = wrows < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = _load_rows(a_ptr, rows, row_ok, stride_a, k, k_hi, UPCAST)  # [BLOCK_M, BLOCK_K]
        w = _load_rows(w_ptr, wrows, w_ok, stride_w, k, k_hi, UPCAST)  # [BLOCK_N, BLOCK_K]
        acc += dot_nt(a, w, DOT_IEEE)
    cols = n0 + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    if SPLIT_K > 1:  # the tile's last program sums the partials; the others store nothing
        store_partial(ws_ptr, acc, rows, cols, mask, M, N, 0, SPLIT_K)
        last = arrive(counter_ptr, SPLIT_K)
        mask = tl.where(last, mask, False)
        acc = sum_partials(ws_ptr, rows, cols, mask, M, N, 0, SPLIT_K, BLOCK_M, BLOCK_N)
    r = tl.load(res_ptr + rows[:, None].to(tl.int64) * stride_r + cols[None, :], mask=mask,
                other=0.0).to(tl.float32)  # fmt: skip
    oty = out_ptr.dtype.element_ty
    y = r + acc.to(oty).to(tl.float32)  # the projection is rounded before the add
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], y.to(oty), mask=mask)


def _split_buffers(launch: LinearLaunch, planes: int, m: int, n: int,
                   out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(partials workspace, arrival counters) of a split launch; `out` stands in for both
    (never touched) when the launch is not split."""
    splits = launch.grid[2]
    if splits == 1:
        return out, out
    return workspace(planes, splits, m, n, out.device), arrival_counters(out.device)


def _precision(x: torch.Tensor) -> dict:
    upcast = interpreter_active() or x.dtype == torch.float32
    return dict(UPCAST=upcast, DOT_IEEE=upcast)


def norm_linear_triton(
    x: torch.Tensor,  # [M, K], K <= MAX_K
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]; SwiGLU: [2I, K]
    swiglu_hidden: int | None = None,
    config: LinearConfig | None = None,
    invariant: bool = False,  # batch-invariant tiles (invariant_config, 16 or 64 rows)
    block_m: int | None = None,  # rows per program tile (sweeps); None: row_tile
    split_k: int | None = None,  # K splits at most, 0: auto; None: SPLITFLASH_LINEAR_SPLIT_K
) -> torch.Tensor:  # [M, N] or [M, I], x's dtype
    """Same contract as norm_linear_ref, for inputs that `fits`."""
    check_linear(x, weight, swiglu_hidden)
    if not fits(x, weight, any_rows=True) or norm_weight.shape != (x.shape[1],):
        raise ValueError(f"norm_linear_triton takes K <= {MAX_K} with unit "
                         f"stride along K; got x {tuple(x.shape)} stride {x.stride()}")  # fmt: skip
    m, k = x.shape
    n = weight.shape[0] if swiglu_hidden is None else swiglu_hidden
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    launch = plan_launch(weight, m, n, k, config, invariant, block_m, split_k)
    ws, counters = _split_buffers(launch, 1 if swiglu_hidden is None else 2, m, n, out)
    folded = fold_norm_weight(weight, norm_weight)
    wide = invariant or launch.meta["BLOCK_M"] > BLOCK_M
    chunk = INVARIANT_NORM_CHUNK if wide else max(16, next_pow2(k))
    _norm_linear_kernel[launch.grid](
        x, folded, out, ws, counters, m, n, k, launch.k_split, x.stride(0), folded.stride(0),
        float(eps), SWIGLU=swiglu_hidden is not None, NORM_CHUNK=chunk,
        WHOLE_ROWS=chunk >= k, **launch.meta, **_precision(x), **pdl_launch(x.device),
    )  # fmt: skip
    return out


def linear_residual_triton(
    a: torch.Tensor,  # [M, K], K <= MAX_K
    weight: torch.Tensor,  # [N, K]
    residual: torch.Tensor,  # [M, N], a's dtype
    config: LinearConfig | None = None,
    invariant: bool = False,  # batch-invariant tiles (invariant_config, 16 or 64 rows)
    block_m: int | None = None,  # rows per program tile (sweeps); None: row_tile
    split_k: int | None = None,  # K splits at most, 0: auto; None: SPLITFLASH_LINEAR_SPLIT_K
) -> torch.Tensor:  # residual + a @ weight.T, [M, N]
    """Same contract as linear_residual_ref, for inputs that `fits`."""
    check_linear(a, weight)
    m, k = a.shape
    n = weight.shape[0]
    if not fits(a, weight, any_rows=True) or residual.shape != (m, n) or residual.stride(1) != 1:
        raise ValueError(f"linear_residual_triton takes K <= {MAX_K}, unit "
                         f"strides and residual [M, N]; got a {tuple(a.shape)}, weight "
                         f"{tuple(weight.shape)}, residual {tuple(residual.shape)}")  # fmt: skip
    out = torch.empty((m, n), device=a.device, dtype=residual.dtype)
    launch = plan_launch(weight, m, n, k, config, invariant, block_m, split_k)
    ws, counters = _split_buffers(launch, 1, m, n, out)
    _linear_residual_kernel[launch.grid](
        a, weight, residual, out, ws, counters, m, n, k, launch.k_split, a.stride(0),
        weight.stride(0), residual.stride(0), **launch.meta, **_precision(a),
        **pdl_launch(a.device),
    )  # fmt: skip
    return out
