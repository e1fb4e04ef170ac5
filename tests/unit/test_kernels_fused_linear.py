"""Small-M linear kernels fused with RMSNorm / SwiGLU / the residual add (kernels/fused_linear.py):
Triton kernel vs torch reference vs fp64 oracles, the dispatch rule, and a whole target forward
through every Triton kernel against the CPU reference path. Kernel tests run under
TRITON_INTERPRET=1 on CPU (fp32, fp16) or natively on CUDA (bf16 too, marked gpu).
Criterion (DESIGN.md 9): err(kernel vs fp64) <= 2 * err(torch ref vs fp64) + atol.
"""

from __future__ import annotations

import logging

import pytest
import torch

from splitflash.kernels.fused_linear_ref import (
    MAX_K,
    MAX_M,
    fits,
    linear_residual_ref,
    norm_linear_ref,
)
from tests.unit.kernel_env import ATOL, DEVICE, needs_gpu, needs_triton

EPS = 1e-5
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])

# (M, K, N): the default model's layers (K 576 / 1536, N 960 / 576, SwiGLU I 1536), odd sizes
# that pad every tile (K 13 / 100, N 17 / 50), one row, 64-row tiles (M > 16), the largest K
# and M taken.
CASES = [(1, 64, 96), (7, 576, 960), (16, 1536, 576), (33, 100, 50), (64, 2048, 40),
         (5, 13, 17), (16, 576, 3072), (128, 96, 40)]  # fmt: skip
IDS = ["x".join(map(str, c)) for c in CASES]


def make_case(m, k, n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different scales: normalising by the wrong row or over padding lanes fails.
    x = torch.randn(m, k, generator=gen) * (torch.rand(m, 1, generator=gen) * 8 + 0.05)
    norm_w = 1 + 0.5 * torch.randn(k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    res = torch.randn(m, n, generator=gen)
    return [t.to(dtype=dtype, device=DEVICE) for t in (x, norm_w, w, res)]


def err(got, want) -> float:
    return (got.double().cpu() - want).abs().max().item()


def check(got, low, want, dtype, what):
    assert got.dtype == low.dtype and got.shape == low.shape, (got.dtype, got.shape, low.shape)
    e_kernel, e_low = err(got, want), err(low, want)
    assert e_kernel <= 2 * e_low + ATOL[dtype], (what, e_kernel, e_low)


def norm_oracle(x, norm_w, w, swiglu_hidden=None):
    x, norm_w, w = (t.double().cpu() for t in (x, norm_w, w))
    y = (norm_w * x / (x.square().mean(-1, keepdim=True) + EPS).sqrt()) @ w.T
    if swiglu_hidden is None:
        return y
    g, u = y.split(swiglu_hidden, dim=-1)
    return g * torch.sigmoid(g) * u


def run_norm_linear(dtype, m, k, n, swiglu, invariant=False, split_k=None):
    from splitflash.kernels.fused_linear import norm_linear_triton

    x, norm_w, w, _ = make_case(m, k, n, dtype, seed=m * k + n)
    hidden = n // 2 if swiglu else None
    w = w[: 2 * hidden] if swiglu else w  # odd N: gate and up of n // 2 columns each
    got = norm_linear_triton(x, norm_w, EPS, w, hidden, invariant=invariant, split_k=split_k)
    low = norm_linear_ref(x, norm_w, EPS, w, hidden)
    what = ("norm_linear", swiglu, invariant)
    check(got, low, norm_oracle(x, norm_w, w, hidden), dtype, what)


def run_linear_residual(dtype, m, k, n, invariant=False, split_k=None):
    from splitflash.kernels.fused_linear import linear_residual_triton

    x, _, w, res = make_case(m, k, n, dtype, seed=m + k * n)
    got = linear_residual_triton(x, w, res, invariant=invariant, split_k=split_k)
    want = res.double().cpu() + x.double().cpu() @ w.double().cpu().T
    check(got, linear_residual_ref(x, w, res), want, dtype, ("linear_residual", invariant))


@needs_triton
@DTYPES
@pytest.mark.parametrize("m,k,n", CASES, ids=IDS)
@pytest.mark.parametrize("swiglu", [False, True], ids=["plain", "swiglu"])
def test_norm_linear_kernel_matches_oracle(m, k, n, swiglu, dtype):
    run_norm_linear(dtype, m, k, n, swiglu)


@needs_triton
@DTYPES
@pytest.mark.parametrize("m,k,n", CASES, ids=IDS)
def test_linear_residual_kernel_matches_oracle(m, k, n, dtype):
    run_linear_residual(dtype, m, k, n)


# Batch-invariant launches (16- or 64-row tiles, chunked norm statistics): the default
# model's layers, every tile padded, and more rows than one tile.
INVARIANT_CASES = [(7, 576, 960), (5, 13, 17), (130, 1536, 576), (16, 576, 3072)]
INVARIANT_IDS = ["x".join(map(str, c)) for c in INVARIANT_CASES]


@needs_triton
@DTYPES
@pytest.mark.parametrize("m,k,n", INVARIANT_CASES, ids=INVARIANT_IDS)
def test_invariant_tiles_match_oracle(m, k, n, dtype):
    run_norm_linear(dtype, m, k, n, swiglu=n % 2 == 0, invariant=True)
    run_linear_residual(dtype, m, k, n, invariant=True)


def check_rows_invariant(dtype, seed, pairs):
    """Each (m, full): the first m rows of a launch on `full` rows are the same bits as a
    launch on those m rows alone (a decode step, a verify block, a batch of blocks)."""
    from splitflash.kernels.fused_linear import linear_residual_triton, norm_linear_triton

    x, norm_w, w, res = make_case(130, 1536, 192, dtype, seed=seed)  # w [192, 1536]
    # The norm + SwiGLU kernel at K 576 (INVARIANT_CONFIG), the residual one at K 1536 (the
    # wide-K config).
    xn, nw, wn = x[:, :576].contiguous(), norm_w[:576], w[:, :576].contiguous()
    for m, full in pairs:
        for part, whole in (
            (norm_linear_triton(xn[:m], nw, EPS, wn, 96, invariant=True),  # SwiGLU
             norm_linear_triton(xn[:full], nw, EPS, wn, 96, invariant=True)),
            (linear_residual_triton(x[:m], w, res[:m], invariant=True),
             linear_residual_triton(x[:full], w, res[:full], invariant=True)),
        ):  # fmt: skip
            assert torch.equal(part, whole[:m]), (m, full, (part - whole[:m]).abs().max())


@needs_triton
def test_invariant_rows_are_the_same_bits_whatever_m():
    """Within one tile height (16 rows up to M 16, 64 above). Rows keep their place in the
    tile here, so the interpreter's numpy products see the same shapes too."""
    check_rows_invariant(torch.float32, 3, [(1, 16), (17, 130), (64, 130), (65, 130)])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(4))
def test_invariant_rows_same_bits_across_tile_heights_bf16_gpu(seed):
    """Across the two tile heights, whose MMA instructions differ on Hopper (mma.sync for 16
    rows, wgmma for 64): the batch-invariant mode relies on their giving the same bits."""
    check_rows_invariant(torch.bfloat16, seed, [(1, 130), (16, 17), (16, 130), (64, 130)])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("m,k,n", CASES, ids=IDS)
def test_fused_linear_kernels_match_oracle_bf16_gpu(m, k, n):
    for swiglu in (False, True):
        for invariant in (False, True):
            run_norm_linear(torch.bfloat16, m, k, n, swiglu, invariant)
    for invariant in (False, True):
        run_linear_residual(torch.bfloat16, m, k, n, invariant)


def test_references_are_the_model_ops_and_reject_bad_shapes():
    from splitflash.kernels.fused_norm import rms_norm_ref
    from splitflash.kernels.silu_mul import silu_mul_ref

    x, norm_w, w, res = (t.cpu() for t in make_case(7, 64, 96, torch.float32))
    normed = rms_norm_ref(x, norm_w, EPS)
    assert torch.equal(norm_linear_ref(x, norm_w, EPS, w), normed @ w.T)
    assert torch.equal(norm_linear_ref(x, norm_w, EPS, w, 48), silu_mul_ref(normed @ w.T, 48))
    assert torch.equal(linear_residual_ref(x, w[:64], res[:, :64]), res[:, :64] + x @ w[:64].T)
    with pytest.raises(ValueError, match=r"x must be \[M, K\] and weight \[N, K\]"):
        norm_linear_ref(x, norm_w, EPS, w[:, :32])
    with pytest.raises(ValueError, match=r"SwiGLU weight must be \[2 \* 40, K\]"):
        norm_linear_ref(x, norm_w, EPS, w, 40)


def test_fits_takes_only_few_rows_and_one_k_tile():
    w = torch.zeros(8, 64)
    assert fits(torch.zeros(MAX_M, 64), w) and fits(torch.zeros(1, 64), w)
    assert not fits(torch.zeros(MAX_M + 1, 64), w)
    assert fits(torch.zeros(MAX_M + 1, 64), w, any_rows=True)  # batch-invariant steps
    assert not fits(torch.zeros(0, 64), w, any_rows=True)
    assert not fits(torch.zeros(4, MAX_K + 1), torch.zeros(8, MAX_K + 1), any_rows=True)
    assert not fits(torch.zeros(4, 128)[:, ::2], w)  # K must have unit stride


@needs_triton
def test_kernels_refuse_what_does_not_fit():
    from splitflash.kernels.fused_linear import linear_residual_triton, norm_linear_triton

    x, norm_w, w, res = make_case(MAX_M + 1, 64, 96, torch.float32)
    xk = torch.zeros(4, MAX_K + 1, device=x.device)
    with pytest.raises(ValueError, match=f"K <= {MAX_K}"):
        norm_linear_triton(xk, torch.ones(MAX_K + 1, device=x.device), EPS, xk)
    with pytest.raises(ValueError, match=r"residual \[M, N\]"):
        linear_residual_triton(x[:4], w, res[:3])
    # More than MAX_M rows: taken (the dispatch sends them to cuBLAS unless any_rows), and
    # each row tile computes what the reference does.
    got = linear_residual_triton(x, w, res)
    torch.testing.assert_close(got, linear_residual_ref(x, w, res), rtol=1e-5, atol=1e-5)


def test_dispatch_rule_and_logged_choice(monkeypatch, caplog):
    from splitflash.kernels import dispatch, fused_dispatch

    x, norm_w, w, res = (t.cpu() for t in make_case(MAX_M + 1, 64, 96, torch.float32))
    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    dispatch._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        big = fused_dispatch.linear_residual(x, w, res)  # too many rows: GEMM + add
        w_grad = w.clone().requires_grad_()
        fused_dispatch.linear_residual(x[:4], w_grad, res[:4]).sum().backward()
    msgs = [r.getMessage() for r in caplog.records]
    assert any("linear_residual: using GEMM + add" in m and f"M <= {MAX_M}" in m for m in msgs)
    assert any("GEMM + add" in m and "gradients" in m for m in msgs), msgs
    assert w_grad.grad is not None and torch.equal(big, linear_residual_ref(x, w, res))
    monkeypatch.delenv("SPLITFLASH_FORCE_TRITON")
    dispatch._announce.cache_clear()
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        got = fused_dispatch.norm_linear(x[:4], norm_w, EPS, w, 48)
    assert any("norm_linear: using norm + GEMM (tensors on cpu)" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert torch.equal(got, norm_linear_ref(x[:4], norm_w, EPS, w, 48))


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu", reason="compares the interpreter with the CPU path")
@pytest.mark.parametrize("family", ["llama", "qwen3"])  # qwen3: q/k norms before the RoPE
def test_target_forward_through_every_kernel_matches_reference_path(monkeypatch, family):
    """Verify steps of a tiny model with every Triton kernel (interpreter) vs the CPU torch
    path: the same committed tokens and features to fp32 rounding."""
    from tests.conftest import tiny_model
    from tests.unit.test_verify_graphs import _engine, _run

    model = tiny_model(family)
    prompts, blocks = [[3, 1, 4, 1, 5, 9, 2], [2, 7]], [4, 1, 6]
    monkeypatch.delenv("SPLITFLASH_FORCE_TRITON", raising=False)
    want = _run(_engine(model, graphs=False), prompts, blocks, seed=3)
    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    got = _run(_engine(model, graphs=False), prompts, blocks, seed=3)
    assert len(got) == len(want) == 2 * len(blocks)
    for (rid_a, tok_a, feat_a), (rid_b, tok_b, feat_b) in zip(want, got, strict=True):
        assert (rid_a, tok_a) == (rid_b, tok_b)
        torch.testing.assert_close(feat_b, feat_a, rtol=1e-4, atol=1e-4)


def test_folded_norm_weight_is_cached_until_a_weight_changes():
    from splitflash.kernels.fused_linear_ref import fold_norm_weight

    _, norm_w, w, _ = (t.cpu() for t in make_case(4, 64, 96, torch.float16))
    w, norm_w = w.clone(), norm_w.clone()
    first = fold_norm_weight(w, norm_w)
    assert torch.equal(first, (w.float() * norm_w.float()).half())
    assert fold_norm_weight(w, norm_w) is first  # cached: a CUDA graph keeps one tensor
    norm_w.mul_(2)  # an in-place update (a reload) must not serve the stale fold
    assert torch.equal(fold_norm_weight(w, norm_w), (w.float() * norm_w.float()).half())
    other = norm_w.clone()  # another norm weight for the same linear
    assert fold_norm_weight(w, other) is not first
    param = torch.nn.Parameter(w.clone(), requires_grad=False)
    on_cpu = fold_norm_weight(param, norm_w)
    param.data = param.data.float()  # what model.to(dtype / device) does to a parameter
    moved = fold_norm_weight(param, norm_w)
    assert moved.dtype == torch.float32 and on_cpu.dtype == torch.float16
    with torch.inference_mode():  # inference tensors have no version counter: no caching
        w_inf, nw_inf = w.clone(), norm_w.clone()
        assert torch.equal(fold_norm_weight(w_inf, nw_inf), (w.float() * norm_w.float()).half())
