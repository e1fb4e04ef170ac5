"""Drafter block attention: Triton kernel vs torch reference vs an fp64 oracle built from the
full context history (independent of the ring-buffer arithmetic), plus the read bound: a
sliding layer reads at most W context keys at any context length.
"""

from __future__ import annotations

import os

import pytest
import torch

from splitflash.kernels.draft_attention_ref import KeysReadCounter, draft_attention_ref

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
CUDA = torch.cuda.is_available()
needs_triton = pytest.mark.skipif(
    not (INTERPRET or CUDA),
    reason="Triton kernels need CUDA or TRITON_INTERPRET=1 (set by `make test`)",
)
needs_gpu = pytest.mark.skipif(
    not CUDA or INTERPRET,
    reason="bf16 kernel tests need a CUDA GPU and TRITON_INTERPRET unset (bf16 is broken there)",
)
DEVICE = "cpu" if INTERPRET or not CUDA else "cuda"
ATOL = {torch.float32: 1e-5, torch.float16: 1e-4, torch.bfloat16: 1e-3}


def make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, dtype, seed=0):
    """Random batch whose ring buffers are filled by replaying each request's whole context
    history in order (slot p % W_cap, later entries overwrite). Requests get shuffled cache
    slots plus one spare slot. Returns (kernel kwargs, histories for the oracle)."""
    gen = torch.Generator().manual_seed(seed)
    n_req = len(n_ctx)
    slots = torch.randperm(n_req + 1, generator=gen)[:n_req]
    ctx_k = torch.randn(n_req + 1, w_cap, kv_heads, dim, generator=gen)  # stale garbage
    ctx_v = torch.randn(n_req + 1, w_cap, kv_heads, dim, generator=gen)
    hist = []
    for r, n in enumerate(n_ctx):
        hk = torch.randn(n, kv_heads, dim, generator=gen)
        hv = torch.randn(n, kv_heads, dim, generator=gen)
        for p0 in range(0, n, w_cap):  # replay in chunks of W_cap: same result as one by one
            p1 = min(n, p0 + w_cap)
            ring = torch.arange(p0, p1) % w_cap
            ctx_k[slots[r], ring], ctx_v[slots[r], ring] = hk[p0:p1], hv[p0:p1]
        hist.append((hk, hv))
    to = dict(device=DEVICE, dtype=dtype)
    case = dict(
        q=torch.randn(n_req, blk, heads, dim, generator=gen).to(**to),
        blk_k=torch.randn(n_req, blk, kv_heads, dim, generator=gen).to(**to),
        blk_v=torch.randn(n_req, blk, kv_heads, dim, generator=gen).to(**to),
        ctx_k=ctx_k.to(**to),
        ctx_v=ctx_v.to(**to),
        n_ctx=torch.tensor(n_ctx, dtype=torch.int32, device=DEVICE),
        window=window,
        scale=dim**-0.5,
        cache_slots=slots.to(device=DEVICE, dtype=torch.int32),
    )
    return case, hist


def history_oracle(case, hist) -> torch.Tensor:
    """fp64 attention of each block over [last W history entries | block], no ring logic.
    The history is rounded to the case dtype first, as the ring buffer holds it."""
    dtype = case["q"].dtype
    q = case["q"].double().cpu()
    group = q.shape[2] // case["blk_k"].shape[2]
    out = torch.empty_like(q)
    for r, (hk, hv) in enumerate(hist):
        w = case["window"]
        lo = 0 if w is None else max(0, hk.shape[0] - w)
        k = torch.cat([hk[lo:].to(dtype).double(), case["blk_k"][r].double().cpu()])
        v = torch.cat([hv[lo:].to(dtype).double(), case["blk_v"][r].double().cpu()])
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[r], k) * case["scale"]
        out[r] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out


# (n_ctx per request, window, W_cap, B_blk, H, H_KV, D, forced splits)
CASES = [
    ([0], 8, 8, 1, 4, 4, 16, None),
    ([5, 8, 13], 8, 8, 7, 6, 2, 32, None),
    ([13, 300, 1], 256, 293, 16, 8, 1, 16, 2),
    ([1000, 40], 300, 300, 16, 6, 2, 16, 3),
    ([4097], 4096, 4096, 16, 3, 1, 16, None),
    ([13, 113], None, 120, 7, 6, 2, 32, None),
    ([4097, 1], None, 4100, 16, 8, 1, 16, 4),
]
IDS = [f"n{c[0]}-w{c[1]}-cap{c[2]}-b{c[3]}-g{c[4] // c[5]}-s{c[7]}" for c in CASES]


def check(case, hist, dtype, **kw):
    from splitflash.kernels.draft_attention import draft_attention_triton

    want = history_oracle(case, hist)
    reads = torch.zeros(len(hist), dtype=torch.int32, device=DEVICE)
    got = draft_attention_triton(**case, keys_read=reads, **kw)
    counter = KeysReadCounter()
    low = draft_attention_ref(**case, counter=counter)
    err_kernel = (got.double().cpu() - want).abs().max().item()
    err_low = (low.double().cpu() - want).abs().max().item()
    assert got.dtype == dtype
    assert err_kernel <= 2 * err_low + ATOL[dtype], (err_kernel, err_low)
    w = case["window"]
    expect = [n if w is None else min(n, w) for n in case["n_ctx"].tolist()]
    assert counter.per_request == expect
    assert reads.tolist() == expect
    if DEVICE == "cuda":  # counting calls skip the autotuner: check the tuned path too
        tuned = draft_attention_triton(**case, **kw)
        assert (tuned.double().cpu() - want).abs().max().item() <= 2 * err_low + ATOL[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n_ctx,window,w_cap,blk,heads,kv_heads,dim,splits", CASES, ids=IDS)
def test_kernel_matches_oracle(n_ctx, window, w_cap, blk, heads, kv_heads, dim, splits, dtype):
    case, hist = make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, dtype, seed=blk)
    check(case, hist, dtype, num_splits=splits)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n_ctx,window,w_cap,blk,heads,kv_heads,dim,splits", CASES, ids=IDS)
def test_kernel_matches_oracle_bf16_gpu(n_ctx, window, w_cap, blk, heads, kv_heads, dim, splits):
    case, hist = make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, torch.bfloat16)
    check(case, hist, torch.bfloat16, num_splits=splits)
    check(case, hist, torch.bfloat16)


@needs_triton
def test_sliding_reads_bounded_by_window_at_long_context():
    # 100k context entries but W = 64: both paths must read exactly 64 context keys.
    case, hist = make_case([100_000, 70], 64, 80, 4, 2, 1, 16, torch.float32)
    check(case, hist, torch.float32)


@pytest.mark.parametrize("n_ctx,window,w_cap,blk,heads,kv_heads,dim,splits", CASES, ids=IDS)
def test_reference_matches_oracle_fp64(n_ctx, window, w_cap, blk, heads, kv_heads, dim, splits):
    case, hist = make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, torch.float64)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    got = draft_attention_ref(**cpu)
    torch.testing.assert_close(got, history_oracle(case, hist), rtol=1e-10, atol=1e-10)


def test_reference_rejects_bad_input():
    case, _ = make_case([5, 9], 8, 8, 4, 4, 2, 16, torch.float32)
    case = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    with pytest.raises(ValueError, match="window"):
        draft_attention_ref(**{**case, "window": 9})
    with pytest.raises(ValueError, match="W_cap >= n_ctx"):
        draft_attention_ref(**{**case, "window": None})
    with pytest.raises(ValueError, match="n_ctx"):
        draft_attention_ref(**{**case, "n_ctx": [1, 2, 3]})
    with pytest.raises(ValueError, match="multiple"):
        draft_attention_ref(**{**case, "q": torch.randn(2, 4, 3, 16)})
