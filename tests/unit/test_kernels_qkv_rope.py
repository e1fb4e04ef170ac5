"""RMSNorm + qkv + RoPE + paged K/V write in one kernel (kernels/qkv_rope.py): kernel vs the
unfused torch reference vs an fp64 oracle built from scratch (normalise, project, rotate by
halves). Under TRITON_INTERPRET=1 on CPU (fp32, fp16), bf16 on the GPU (marked gpu).
Criterion (DESIGN.md 9): err(kernel vs fp64) <= 2 * err(torch ref vs fp64) + atol.
"""

from __future__ import annotations

import copy

import pytest
import torch

from splitflash.kernels.fused_linear import norm_linear_ref
from splitflash.kernels.qkv_rope import norm_qkv_rope_ref, split_heads
from splitflash.kernels.rope_kv import rope_kv_write_ref
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.target import rope_cos_sin
from tests.unit.kernel_env import DEVICE, needs_gpu, needs_triton
from tests.unit.test_kernels_fused import check_rule, rope_oracle

EPS = 1e-5
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
LAYER = 1  # of 2: the pages are a view into the middle of the cache tensor

# (N rows, K, H, H_KV, Dh, page size): the default model's layer (9/3 heads of 64, K 576),
# MHA, Dh 128 (several pair tiles per head), Dh 8 (pairs padded to a tile), two row tiles.
CASES = [(16, 576, 9, 3, 64, 16), (7, 64, 4, 4, 128, 1), (33, 100, 2, 1, 8, 4),
         (1, 576, 9, 3, 64, 16)]  # fmt: skip
IDS = [f"n{c[0]}-k{c[1]}-h{c[2]}/{c[3]}-d{c[4]}-p{c[5]}" for c in CASES]


def make_case(n, k, heads, kv_heads, dim, page, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different scales: normalising by the wrong row fails.
    x = torch.randn(n, k, generator=gen) * (torch.rand(n, 1, generator=gen) * 8 + 0.05)
    norm_w = 1 + 0.5 * torch.randn(k, generator=gen)
    w = torch.randn((heads + 2 * kv_heads) * dim, k, generator=gen) / k**0.5
    positions = torch.randint(0, 40000, (n,), generator=gen)
    cos, sin = rope_cos_sin(positions, dim, 1e6, torch.float32)
    n_pages = -(-2 * n // page) + 1  # twice the slots needed, handed out at random
    slots = torch.randperm(n_pages * page, generator=gen)[:n]
    case = dict(x=x, norm_weight=norm_w, weight=w, cos=cos, sin=sin)
    case = {name: t.to(dtype=dtype, device=DEVICE) for name, t in case.items()}
    cache = PagedKVCache(2, n_pages, page, kv_heads, dim, dtype=dtype, device=DEVICE)
    cache.k.fill_(float("nan"))  # poison: an unwritten slot or a stray write shows
    cache.v.fill_(float("nan"))
    return dict(case, eps=EPS, slots=slots.to(DEVICE), n_heads=heads, n_kv_heads=kv_heads), cache


def run(fn, case, cache):
    q = fn(**case, k_pages=cache.k[LAYER], v_pages=cache.v[LAYER])
    return q, cache.k[LAYER].flatten(0, 1), cache.v[LAYER].flatten(0, 1)  # [P * S, H_KV, Dh]


def oracle(case):
    """fp64 from scratch: (q rotated, k rotated, v) of every row."""
    x, nw, w = (case[name].double().cpu() for name in ("x", "norm_weight", "weight"))
    y = (nw * x / (x.square().mean(-1, keepdim=True) + EPS).sqrt()) @ w.T
    q, k, v = split_heads(y, case["n_heads"], case["n_kv_heads"])
    return rope_oracle(q, case["cos"], case["sin"]), rope_oracle(k, case["cos"], case["sin"]), v


def check(case, cache, dtype):
    from splitflash.kernels.qkv_rope import norm_qkv_rope_triton

    ref_cache = copy.deepcopy(cache)
    q, flat_k, flat_v = run(norm_qkv_rope_triton, case, cache)
    q_low, low_k, low_v = run(norm_qkv_rope_ref, case, ref_cache)
    want_q, want_k, want_v = oracle(case)
    assert q.dtype == dtype and q.shape == q_low.shape
    slots = case["slots"]
    check_rule(q, q_low, want_q, dtype, "q")
    check_rule(flat_k[slots], low_k[slots], want_k, dtype, "k pages")
    check_rule(flat_v[slots], low_v[slots], want_v, dtype, "v pages")
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()
    assert cache.k[1 - LAYER].isnan().all() and cache.v[1 - LAYER].isnan().all()


@needs_triton
@DTYPES
@pytest.mark.parametrize("n,k,heads,kv_heads,dim,page", CASES, ids=IDS)
def test_norm_qkv_rope_kernel_matches_oracle(n, k, heads, kv_heads, dim, page, dtype):
    case, cache = make_case(n, k, heads, kv_heads, dim, page, dtype, seed=n + dim)
    check(case, cache, dtype)


@needs_triton
def test_kernel_uses_both_cos_sin_halves():
    # rope_cos_sin repeats its frequencies in both halves, which would hide a kernel reading
    # one half for both; the contract is apply_rope's for any cos / sin.
    case, cache = make_case(7, 64, 3, 1, 32, 4, torch.float32, seed=5)
    gen = torch.Generator().manual_seed(6)
    case["cos"], case["sin"] = (torch.randn(7, 1, 32, generator=gen).to(DEVICE) for _ in "cs")
    check(case, cache, torch.float32)


def test_reference_is_norm_linear_then_rope_kv():
    case, cache = make_case(5, 64, 4, 2, 16, 4, torch.float32)
    want_cache = copy.deepcopy(cache)
    q, _, _ = run(norm_qkv_rope_ref, case, cache)
    qkv = norm_linear_ref(case["x"], case["norm_weight"], EPS, case["weight"])
    want = rope_kv_write_ref(*split_heads(qkv, 4, 2), case["cos"], case["sin"],
                             want_cache.k[LAYER], want_cache.v[LAYER], case["slots"])  # fmt: skip
    assert torch.equal(q, want)
    assert torch.equal(cache.k.nan_to_num(7.0), want_cache.k.nan_to_num(7.0))
    assert torch.equal(cache.v.nan_to_num(7.0), want_cache.v.nan_to_num(7.0))
    with pytest.raises(ValueError, match="not 4 q \\+ 2 x 3 kv heads"):
        norm_qkv_rope_ref(**{**case, "n_kv_heads": 3}, k_pages=cache.k[0], v_pages=cache.v[0])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n,k,heads,kv_heads,dim,page", CASES, ids=IDS)
def test_norm_qkv_rope_kernel_matches_oracle_bf16_gpu(n, k, heads, kv_heads, dim, page):
    case, cache = make_case(n, k, heads, kv_heads, dim, page, torch.bfloat16, seed=1)
    check(case, cache, torch.bfloat16)

