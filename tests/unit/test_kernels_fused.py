"""Fused RMSNorm (+ residual) and RoPE + paged KV write: Triton kernel vs torch reference vs
independent fp64 oracles; the references are held bit-equal to the model code they replace.
Kernel tests run under TRITON_INTERPRET=1 on CPU (fp32, fp16) or natively on CUDA; bf16 needs
a GPU. Criterion (DESIGN.md 9): err(kernel vs fp64) <= 2 * err(torch ref vs fp64) + atol.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from splitflash.kernels.fused_norm import rms_norm_ref
from splitflash.kernels.rope_kv import rope_kv_write_ref
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.target import RMSNorm, apply_rope, rope_cos_sin
from tests.unit.kernel_env import ATOL, DEVICE, needs_gpu, needs_triton

EPS = 1e-6
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    # nan-propagating: an unwritten (poisoned) value fails every comparison below.
    return (got.double().cpu() - want).abs().max().item()


def check_rule(got, low, want, dtype, what):
    err_kernel, err_low = max_err(got, want), max_err(low, want)
    assert err_kernel <= 2 * err_low + ATOL[dtype], (what, err_kernel, err_low)


# --- RMSNorm ------------------------------------------------------------------------------

# (x shape, with residual, x is a strided view): D in {64, 576, 960}, N in {1, 7, 64, 113};
# the 3-D case is the per-head q/k norm layout [N, H, Dh].
NORM_CASES = [
    ((1, 64), False, False), ((7, 576), True, True), ((64, 960), False, True),
    ((113, 576), True, False), ((113, 960), True, False), ((64, 64), True, True),
    ((7, 9, 64), False, True),
]  # fmt: skip
NORM_IDS = [f"{'x'.join(map(str, c[0]))}-{'res' if c[1] else 'nores'}" for c in NORM_CASES]


def make_norm_case(shape, residual, strided, dtype, w_dtype=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    d = shape[-1]
    rows = shape[:-1]
    # Rows of very different scales: a kernel normalising by the wrong row or over padding
    # lanes cannot pass. A strided x is a column slice of a wider activation.
    scale = torch.rand(*rows, 1, generator=gen) * 8 + 0.05
    wide = torch.randn(*rows, d + (37 if strided else 0), generator=gen) * scale
    x = wide.to(dtype=dtype, device=DEVICE)[..., :d]
    assert x.is_contiguous() != strided
    res = torch.randn(*shape, generator=gen) if residual else None
    w = 1 + 0.5 * torch.randn(d, generator=gen)
    return dict(
        x=x,
        weight=w.to(dtype=w_dtype or dtype, device=DEVICE),
        eps=EPS,
        residual=None if res is None else res.to(dtype=dtype, device=DEVICE),
    )


def norm_oracle(x, weight, eps, residual=None):
    """fp64 weight * h / sqrt(mean(h^2) + eps), h = x (+ residual) exactly: no roundings."""
    h = x.double().cpu() + (0 if residual is None else residual.double().cpu())
    return weight.double().cpu() * h / (h.square().mean(-1, keepdim=True) + eps).sqrt()


def check_norm(case, dtype):
    from splitflash.kernels.fused_norm import rms_norm_triton

    got, low = rms_norm_triton(**case), rms_norm_ref(**case)
    want = norm_oracle(**case)
    if case["residual"] is not None:
        (got, got_h), (low, low_h) = got, low
        # h is one correctly rounded add either way: bit-equal to torch's x + residual.
        assert got_h.dtype == dtype and got_h.shape == case["x"].shape
        assert torch.equal(got_h, case["x"] + case["residual"])
        assert torch.equal(got_h, low_h)
    assert got.dtype == low.dtype and got.shape == case["x"].shape
    check_rule(got, low, want, dtype, "rms_norm")
    if dtype != torch.float32:
        # Rounding to x.dtype before the weight (target.RMSNorm) is below the rule's
        # resolution; bit equality shows it: only fp32 summation order / rsqrt ulps may flip
        # a rounding here, where skipping that cast flips ~25% of fp16 elements.
        same = (got == low).float().mean().item()
        assert same >= 0.99, ("fraction bit-equal to the reference", same)


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape,residual,strided", NORM_CASES, ids=NORM_IDS)
def test_rms_norm_kernel_matches_oracle(shape, residual, strided, dtype):
    check_norm(make_norm_case(shape, residual, strided, dtype, seed=shape[0]), dtype)


@needs_triton
def test_rms_norm_kernel_fp32_weight_promotes():
    # fp16 activations with an fp32 weight: torch promotion makes the output fp32.
    case = make_norm_case((7, 576), True, False, torch.float16, w_dtype=torch.float32)
    assert rms_norm_ref(**case)[0].dtype == torch.float32
    check_norm(case, torch.float16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rms_norm_ref_is_the_model_norm(dtype):
    case = make_norm_case((7, 576), False, True, dtype)
    case = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    norm = RMSNorm(576, EPS).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(case["weight"])
        assert torch.equal(rms_norm_ref(case["x"], case["weight"], EPS), norm(case["x"]))
        res = torch.randn(7, 576).to(dtype)
        out, h = rms_norm_ref(case["x"], case["weight"], EPS, res)
        assert torch.equal(h, case["x"] + res) and torch.equal(out, norm(case["x"] + res))
    with pytest.raises(ValueError, match="residual"):
        rms_norm_ref(case["x"], case["weight"], EPS, res.float() if dtype != torch.float32
                     else res.half())  # fmt: skip


# --- RoPE + paged KV write ----------------------------------------------------------------

# (N, H, H_KV, Dh, page size, q/k/v are views of a fused qkv output). The interpreter runs
# N * H_KV programs one by one: sizes are chosen to cover every value, not every product.
ROPE_CASES = [
    (1, 9, 3, 64, 1, True), (7, 8, 8, 128, 16, False), (64, 32, 8, 128, 16, True),
    (113, 9, 3, 128, 1, True), (113, 9, 3, 64, 16, False),
]  # fmt: skip
ROPE_IDS = [f"n{c[0]}-h{c[1]}/{c[2]}-d{c[3]}-p{c[4]}" for c in ROPE_CASES]
LAYER = 1  # of 2: the pages passed are a view into the middle of the cache tensor


def make_rope_case(n, heads, kv_heads, dim, page, fused, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q_dim, kv_dim = heads * dim, kv_heads * dim
    if fused:  # as Attention.forward: split + view, rows strided by the qkv width
        q, k, v = torch.randn(n, q_dim + 2 * kv_dim, generator=gen).split(
            (q_dim, kv_dim, kv_dim), dim=-1)  # fmt: skip
    else:
        q, k, v = (torch.randn(n, w, generator=gen) for w in (q_dim, kv_dim, kv_dim))
    q, k, v = (t.to(dtype=dtype, device=DEVICE) for t in (q, k, v))
    positions = torch.randint(0, 40000, (n,), generator=gen).to(DEVICE)
    cos, sin = rope_cos_sin(positions, dim, 1e6, dtype)
    # Twice the slots needed, handed out at random: neither contiguous nor in order.
    n_pages = -(-2 * n // page) + 1
    slots = torch.randperm(n_pages * page, generator=gen)[:n].to(DEVICE)
    cache = PagedKVCache(2, n_pages, page, kv_heads, dim, dtype=dtype, device=DEVICE)
    cache.k.fill_(float("nan"))  # poison: an unwritten slot or a stray write shows
    cache.v.fill_(float("nan"))
    return dict(q=q.view(n, heads, dim), k=k.view(n, kv_heads, dim), v=v.view(n, kv_heads, dim),
                cos=cos, sin=sin, slots=slots), cache  # fmt: skip


def rope_oracle(x, cos, sin):
    """fp64 rotate-half by halves: [x1 c1 - x2 s1, x2 c2 + x1 s2]."""
    x, cos, sin = (t.double().cpu() for t in (x, cos, sin))
    h = x.shape[-1] // 2
    (x1, x2), (c1, c2), (s1, s2) = (t.split(h, dim=-1) for t in (x, cos, sin))
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def run_rope(fn, case, cache):
    q_rot = fn(**case, k_pages=cache.k[LAYER], v_pages=cache.v[LAYER])
    return q_rot, cache.k[LAYER].flatten(0, 1), cache.v[LAYER].flatten(0, 1)  # [P * S, ...]


def check_rope(case, cache, dtype):
    from splitflash.kernels.rope_kv import rope_kv_write_triton

    ref_cache = copy.deepcopy(cache)
    q_rot, flat_k, flat_v = run_rope(rope_kv_write_triton, case, cache)
    q_low, low_k, _ = run_rope(rope_kv_write_ref, case, ref_cache)
    assert q_rot.dtype == dtype and q_rot.shape == case["q"].shape
    slots = case["slots"]
    check_rule(q_rot, q_low, rope_oracle(case["q"], case["cos"], case["sin"]), dtype, "q")
    check_rule(flat_k[slots], low_k[slots], rope_oracle(case["k"], case["cos"], case["sin"]),
               dtype, "k pages")  # fmt: skip
    assert torch.equal(flat_v[slots], case["v"])  # v is copied, not rotated
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    assert cache.k[1 - LAYER].isnan().all() and cache.v[1 - LAYER].isnan().all()


@needs_triton
@DTYPES
@pytest.mark.parametrize("n,heads,kv_heads,dim,page,fused", ROPE_CASES, ids=ROPE_IDS)
def test_rope_kv_kernel_matches_oracle(n, heads, kv_heads, dim, page, fused, dtype):
    case, cache = make_rope_case(n, heads, kv_heads, dim, page, fused, dtype, seed=n + page)
    check_rope(case, cache, dtype)


@needs_triton
@DTYPES
def test_rope_kv_kernel_uses_both_cos_sin_halves(dtype):
    # rope_cos_sin repeats its frequencies in both halves, which would hide a kernel reading
    # one half for both; the contract is apply_rope's for any cos/sin.
    case, cache = make_rope_case(7, 9, 3, 64, 16, True, dtype, seed=3)
    gen = torch.Generator().manual_seed(4)
    case["cos"], case["sin"] = (torch.randn(7, 1, 64, generator=gen).to(dtype=dtype, device=DEVICE)
                                for _ in range(2))  # fmt: skip
    check_rope(case, cache, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rope_kv_ref_is_the_model_path(dtype):
    case, cache = make_rope_case(7, 9, 3, 64, 16, True, dtype)
    case = {k: v.cpu() for k, v in case.items()}
    cache.k, cache.v = cache.k.cpu(), cache.v.cpu()
    want = copy.deepcopy(cache)
    q_rot = rope_kv_write_ref(**case, k_pages=cache.k[LAYER], v_pages=cache.v[LAYER])
    # The unfused Attention.forward steps, verbatim.
    q, k = apply_rope(case["q"], case["cos"], case["sin"]), apply_rope(
        case["k"], case["cos"], case["sin"])  # fmt: skip
    want.write(LAYER, case["slots"], k, case["v"])
    assert torch.equal(q_rot, q)
    assert torch.equal(cache.k.nan_to_num(7.0), want.k.nan_to_num(7.0))
    assert torch.equal(cache.v.nan_to_num(7.0), want.v.nan_to_num(7.0))
    with pytest.raises(ValueError, match="multiple"):
        rope_kv_write_ref(**{**case, "q": case["q"][:, :8]}, k_pages=cache.k[LAYER],
                          v_pages=cache.v[LAYER])  # fmt: skip


# --- bf16 on the GPU ----------------------------------------------------------------------


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape,residual,strided", NORM_CASES, ids=NORM_IDS)
def test_rms_norm_kernel_matches_oracle_bf16_gpu(shape, residual, strided):
    check_norm(make_norm_case(shape, residual, strided, torch.bfloat16, seed=1), torch.bfloat16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,heads,kv_heads,dim,page,fused", ROPE_CASES, ids=ROPE_IDS)
def test_rope_kv_kernel_matches_oracle_bf16_gpu(n, heads, kv_heads, dim, page, fused):
    case, cache = make_rope_case(n, heads, kv_heads, dim, page, fused, torch.bfloat16, seed=1)
    check_rope(case, cache, torch.bfloat16)


# --- dispatch -----------------------------------------------------------------------------


@needs_triton
def test_dispatcher_forced_triton_logs_choice(monkeypatch, caplog):
    from splitflash.kernels import dispatch, fused_dispatch

    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    dispatch._announce.cache_clear()
    norm = make_norm_case((7, 64), True, False, torch.float32)
    case, cache = make_rope_case(7, 8, 8, 64, 16, True, torch.float32)
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        out, _ = fused_dispatch.rms_norm(**norm)
        q_rot = fused_dispatch.rope_kv_write(**case, k_pages=cache.k[1], v_pages=cache.v[1])
    msgs = [r.getMessage() for r in caplog.records]
    for kernel in ("rms_norm", "rope_kv_write"):
        assert any(f"{kernel}: using triton" in m for m in msgs), msgs
    torch.testing.assert_close(out, rms_norm_ref(**norm)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_rot, apply_rope(case["q"], case["cos"], case["sin"]))


def test_dispatcher_uses_reference_on_cpu(monkeypatch, caplog):
    from splitflash.kernels import dispatch, fused_dispatch

    monkeypatch.delenv("SPLITFLASH_FORCE_TRITON", raising=False)
    dispatch._announce.cache_clear()
    norm = {k: v.cpu() if torch.is_tensor(v) else v
            for k, v in make_norm_case((7, 64), False, False, torch.float32).items()}  # fmt: skip
    k_pages = torch.zeros(4, 16, 2, 64)
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    cos, sin = rope_cos_sin(torch.tensor([0, 5, 9]), 64, 1e4, torch.float32)
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        out = fused_dispatch.rms_norm(**norm)
        q_rot = fused_dispatch.rope_kv_write(q, k, k, cos, sin, k_pages, k_pages.clone(),
                                             torch.tensor([40, 3, 17]))  # fmt: skip
    msgs = [r.getMessage() for r in caplog.records]
    for kernel in ("rms_norm", "rope_kv_write"):
        assert any(f"{kernel}: using torch reference" in m for m in msgs), msgs
    assert torch.equal(out, rms_norm_ref(**norm))
    assert torch.equal(q_rot, apply_rope(q, cos, sin))
    assert torch.equal(k_pages.view(-1, 2, 64)[40], apply_rope(k, cos, sin)[0])


# --- SwiGLU activation (silu(gate) * up) --------------------------------------------------

# (gate_up shape, strided): I in {64, 100, 1536}; 3-D rows as drafter training feeds them.
SILU_CASES = [((1, 128), False), ((7, 200), True), ((113, 3072), False), ((2, 5, 128), False)]
SILU_IDS = ["x".join(map(str, c[0])) + ("-strided" if c[1] else "") for c in SILU_CASES]


def make_silu_case(shape, strided, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Gates from -12 to 12 cover silu's saturated tails as well as its bend.
    wide = torch.randn(*shape[:-1], shape[-1] + (9 if strided else 0), generator=gen) * 4
    return wide.clamp(-12, 12).to(dtype=dtype, device=DEVICE)[..., : shape[-1]]


def silu_oracle(gate_up):
    g, u = gate_up.double().cpu().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@needs_triton
@DTYPES
@pytest.mark.parametrize("shape,strided", SILU_CASES, ids=SILU_IDS)
def test_silu_mul_kernel_matches_oracle(shape, strided, dtype):
    from splitflash.kernels.silu_mul import silu_mul_ref, silu_mul_triton

    gate_up = make_silu_case(shape, strided, dtype, seed=shape[-1])
    hidden = shape[-1] // 2
    got = silu_mul_triton(gate_up, hidden)
    assert got.dtype == dtype and got.shape == (*shape[:-1], hidden)
    check_rule(got, silu_mul_ref(gate_up, hidden), silu_oracle(gate_up), dtype, "silu_mul")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("shape,strided", SILU_CASES, ids=SILU_IDS)
def test_silu_mul_kernel_matches_oracle_bf16_gpu(shape, strided):
    from splitflash.kernels.silu_mul import silu_mul_ref, silu_mul_triton

    gate_up = make_silu_case(shape, strided, torch.bfloat16, seed=shape[-1])
    hidden = shape[-1] // 2
    got = silu_mul_triton(gate_up, hidden)
    check_rule(got, silu_mul_ref(gate_up, hidden), silu_oracle(gate_up), torch.bfloat16, "silu")


def test_silu_mul_ref_is_the_model_path_and_rejects_bad_widths():
    from splitflash.kernels.silu_mul import silu_mul_ref

    gate_up = make_silu_case((7, 200), False, torch.bfloat16).cpu()
    gate, up = gate_up.split(100, dim=-1)
    assert torch.equal(silu_mul_ref(gate_up, 100), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match=r"gate_up must be \[\.\.\., 2 \* 64\]"):
        silu_mul_ref(gate_up, 64)


def test_silu_mul_dispatch_keeps_autograd_on_the_reference(monkeypatch, caplog):
    from splitflash.kernels import dispatch, fused_dispatch

    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    dispatch._announce.cache_clear()
    gate_up = torch.randn(3, 8, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        fused_dispatch.silu_mul(gate_up, 4).sum().backward()
    assert gate_up.grad is not None and gate_up.grad.abs().sum() > 0
    assert any("silu_mul: using torch reference" in r.getMessage() and "gradients" in
               r.getMessage() for r in caplog.records)  # fmt: skip
