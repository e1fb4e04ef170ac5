"""Drafter block attention: the torch reference against the model's own `block_attention`
(what the drafter was trained with), the Triton kernel against the reference and an fp64
oracle built from the full context history (independent of the ring-buffer arithmetic and
of the W - 1 read cut), plus the read bound: a sliding layer reads min(n_ctx, W - 1) context
keys at any context length.
"""

from __future__ import annotations

import pytest
import torch

from splitflash.kernels.dispatch import draft_attention
from splitflash.kernels.draft_attention_ref import KeysReadCounter, draft_attention_ref
from splitflash.models.dflash.cache import LayerKV, block_attention
from tests.unit.kernel_env import ATOL, DEVICE, needs_gpu, needs_triton


def reads(n: int, window: int | None) -> int:
    return n if window is None else min(n, window - 1)


def awkward_lengths(window: int | None) -> list[int]:
    w = 16 if window is None else window
    return [0, 1, 13, w - 1, w, w + 1, 4 * w + 3]


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen, dtype=torch.float64)


def make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, dtype, causal=False, seed=0):
    """Random batch in the kernel's layout. w_cap None: each request's ring is the drafter's
    own LayerKV, filled by random-sized appends (slot p % W, grown lazily), padded with
    garbage to a common W_cap; requests sit in slot r. w_cap an int: rings of W_cap slots
    filled by replaying the history (slot p % W_cap), shuffled slots plus a spare one.
    Returns (kernel kwargs, histories [n, H_KV, D] fp64, LayerKVs or None)."""
    gen = torch.Generator().manual_seed(seed)
    n_req = len(n_ctx)
    hist = [(_randn(gen, n, kv_heads, dim), _randn(gen, n, kv_heads, dim)) for n in n_ctx]
    kvs = None
    if w_cap is None:
        kvs = []
        for hk, hv in hist:
            kv, pos = LayerKV(window, kv_heads, dim, torch.float64, "cpu"), 0
            while pos < hk.shape[0]:
                step = int(torch.randint(1, 2 * (window or 8), (1,), generator=gen))
                end = min(hk.shape[0], pos + step)
                kv.write(hk[pos:end], hv[pos:end], pos)
                pos = end
            kvs.append(kv)
        slots = torch.arange(n_req)
        ctx_k = _randn(gen, n_req, max(kv.capacity for kv in kvs), kv_heads, dim)  # garbage
        ctx_v = _randn(gen, *ctx_k.shape)
        for r, kv in enumerate(kvs):
            ctx_k[r, : kv.capacity], ctx_v[r, : kv.capacity] = kv.k, kv.v
    else:
        slots = torch.randperm(n_req + 1, generator=gen)[:n_req]
        ctx_k = _randn(gen, n_req + 1, w_cap, kv_heads, dim)  # stale garbage
        ctx_v = _randn(gen, *ctx_k.shape)
        for r, (hk, hv) in enumerate(hist):
            for p0 in range(0, hk.shape[0], w_cap):  # chunks of W_cap: same as one by one
                p1 = min(hk.shape[0], p0 + w_cap)
                ring = torch.arange(p0, p1) % w_cap
                ctx_k[slots[r], ring], ctx_v[slots[r], ring] = hk[p0:p1], hv[p0:p1]
    to = dict(device=DEVICE, dtype=dtype)
    case = dict(
        q=_randn(gen, n_req, blk, heads, dim).to(**to),
        blk_k=_randn(gen, n_req, blk, kv_heads, dim).to(**to),
        blk_v=_randn(gen, n_req, blk, kv_heads, dim).to(**to),
        ctx_k=ctx_k.to(**to),
        ctx_v=ctx_v.to(**to),
        n_ctx=torch.tensor(n_ctx, dtype=torch.int32, device=DEVICE),
        window=window,
        scale=dim**-0.5,
        causal=causal,
        cache_slots=slots.to(device=DEVICE, dtype=torch.int32),
    )
    return case, hist, kvs


def history_oracle(case, hist) -> torch.Tensor:
    """fp64 attention of each block over [whole history | block] with one dense mask from
    the visibility rule (no ring, no read cut). History rounded to the case dtype first."""
    dtype, w, causal = case["q"].dtype, case["window"], case["causal"]
    q = case["q"].double().cpu()
    blk, group = q.shape[1], q.shape[2] // case["blk_k"].shape[2]
    out = torch.empty_like(q)
    for r, (hk, hv) in enumerate(hist):
        n = hk.shape[0]
        k = torch.cat([hk.to(dtype).double(), case["blk_k"][r].double().cpu()])
        v = torch.cat([hv.to(dtype).double(), case["blk_v"][r].double().cpu()])
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        rel = torch.arange(n, n + blk)[:, None] - torch.arange(n + blk)[None, :]
        hide = (rel < 0) if causal else torch.zeros_like(rel, dtype=torch.bool)
        if w is not None:
            hide |= (rel >= w) | ((-rel >= w) & ~torch.tensor(causal))
        s = torch.einsum("qhd,khd->hqk", q[r], k) * case["scale"]
        s = s.masked_fill(hide, float("-inf"))
        out[r] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)
    return out


def check(case, hist, dtype, **kw):
    from splitflash.kernels.draft_attention import draft_attention_triton

    want = history_oracle(case, hist)
    counted = torch.zeros(len(hist), dtype=torch.int32, device=DEVICE)
    got = draft_attention_triton(**case, keys_read=counted, **kw)
    counter = KeysReadCounter()
    low = draft_attention_ref(**case, counter=counter)
    err_kernel = (got.double().cpu() - want).abs().max().item()
    err_low = (low.double().cpu() - want).abs().max().item()
    assert got.dtype == dtype
    assert err_kernel <= 2 * err_low + ATOL[dtype], (err_kernel, err_low)
    expect = [reads(n, case["window"]) for n in case["n_ctx"].tolist()]
    assert counter.per_request == expect
    assert counted.tolist() == expect
    if DEVICE == "cuda":  # counting calls skip the autotuner: check the tuned path too
        tuned = draft_attention_triton(**case, **kw)
        assert (tuned.double().cpu() - want).abs().max().item() <= 2 * err_low + ATOL[dtype]


@pytest.mark.parametrize("causal", [False, True], ids=["bidir", "causal"])
@pytest.mark.parametrize("window", [4, 16, 40, None], ids=["w4", "w16", "w40", "full"])
def test_reference_equals_block_attention(window, causal):
    """The reference is the model's function: same outputs and rows read, on the drafter's
    own cache (W = 40 keeps rings smaller than W before they wrap)."""
    for i, (blk, heads) in enumerate([(b, h) for b in (1, 2, 7, 16) for h in (2, 6)]):
        n_ctx = awkward_lengths(window)
        case, _, kvs = make_case(n_ctx, window, None, blk, heads, 2, 8, torch.float64, causal, i)
        case = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
        counter = KeysReadCounter()
        got = draft_attention_ref(**case, counter=counter)
        for r, (n, kv) in enumerate(zip(n_ctx, kvs, strict=True)):
            blk_kv = (case["blk_k"][r], case["blk_v"][r])
            want, n_read = block_attention(case["q"][r], kv.k, kv.v, n, window, *blk_kv, causal)
            torch.testing.assert_close(got[r], want, rtol=1e-12, atol=1e-12)
            assert counter.per_request[r] == n_read == reads(n, window)


@pytest.mark.parametrize("causal", [False, True])
def test_dispatch_forwards_causality(causal):
    case, _, _ = make_case([3, 20], 8, None, 6, 4, 2, 16, torch.float32, causal)
    got = draft_attention(**case)  # Triton on CUDA / forced, else the reference
    want = draft_attention_ref(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()})
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    other = draft_attention_ref(**{**case, "causal": not causal})
    assert not torch.allclose(got.cpu(), other.cpu(), atol=1e-3)


# (window, causal, B_blk for G = 1, B_blk for G = 3): every awkward n_ctx in one batch.
AWKWARD = [(4, False, 1, 16), (4, True, 16, 7), (16, False, 7, 1), (16, True, 2, 16),
           (None, False, 16, 5), (None, True, 1, 16)]  # fmt: skip


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("window,causal,blk1,blk3", AWKWARD)
def test_kernel_matches_reference_awkward_sizes(window, causal, blk1, blk3, dtype):
    for seed, (blk, heads) in enumerate([(blk1, 1), (blk3, 3)]):
        n_ctx = awkward_lengths(window)
        case, hist, _ = make_case(n_ctx, window, None, blk, heads, 1, 16, dtype, causal, seed)
        check(case, hist, dtype)


# (n_ctx per request, window, W_cap, B_blk, H, H_KV, D, forced splits, causal)
CASES = [
    ([0], 8, 8, 1, 4, 4, 16, None, False),
    ([5, 8, 13], 8, 8, 7, 6, 2, 32, None, True),
    ([13, 300, 1], 256, 293, 16, 8, 1, 16, 2, False),  # W_cap > W
    ([1000, 40], 300, 300, 16, 6, 2, 16, 3, True),
    ([4097], 4096, 4096, 16, 3, 1, 16, None, False),
    ([0, 13, 5], 16, 13, 4, 3, 1, 16, None, False),  # ring not wrapped yet: W_cap < W
    ([9, 2], 4, 4, 16, 3, 1, 16, None, False),  # block longer than the window
    ([13, 113], None, 120, 7, 6, 2, 32, None, True),
    ([4097, 1], None, 4100, 16, 8, 1, 16, 4, False),
]
IDS = [f"n{c[0]}-w{c[1]}-cap{c[2]}-b{c[3]}-g{c[4] // c[5]}-s{c[7]}-c{int(c[8])}" for c in CASES]


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("n_ctx,window,w_cap,blk,heads,kv_heads,dim,splits,causal", CASES, ids=IDS)
def test_kernel_matches_oracle(
    n_ctx, window, w_cap, blk, heads, kv_heads, dim, splits, causal, dtype
):  # fmt: skip
    case, hist, _ = make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, dtype, causal, blk)
    check(case, hist, dtype, num_splits=splits)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("n_ctx,window,w_cap,blk,heads,kv_heads,dim,splits,causal", CASES, ids=IDS)
def test_kernel_matches_oracle_bf16_gpu(
    n_ctx, window, w_cap, blk, heads, kv_heads, dim, splits, causal
):  # fmt: skip
    bf16 = torch.bfloat16
    case, hist, _ = make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, bf16, causal)
    check(case, hist, bf16, num_splits=splits)
    check(case, hist, bf16)


@needs_triton
def test_sliding_reads_bounded_by_window_at_long_context():
    # 100k context entries but W = 64: both paths must read exactly W - 1 = 63 context keys.
    case, hist, _ = make_case([100_000, 70], 64, 80, 4, 2, 1, 16, torch.float32)
    check(case, hist, torch.float32)


@pytest.mark.parametrize("n_ctx,window,w_cap,blk,heads,kv_heads,dim,splits,causal", CASES, ids=IDS)
def test_reference_matches_oracle_fp64(
    n_ctx, window, w_cap, blk, heads, kv_heads, dim, splits, causal
):  # fmt: skip
    f64 = torch.float64
    case, hist, _ = make_case(n_ctx, window, w_cap, blk, heads, kv_heads, dim, f64, causal)
    cpu = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    got = draft_attention_ref(**cpu)
    torch.testing.assert_close(got, history_oracle(case, hist), rtol=1e-10, atol=1e-10)


def test_reference_rejects_bad_input():
    case, _, _ = make_case([5, 9], 8, 8, 4, 4, 2, 16, torch.float32)
    case = {k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()}
    draft_attention_ref(**{**case, "window": 9})  # reads 8 = W_cap rows: fine
    with pytest.raises(ValueError, match="window 10 reads the last 9"):
        draft_attention_ref(**{**case, "window": 10})
    with pytest.raises(ValueError, match="window 0"):
        draft_attention_ref(**{**case, "window": 0})
    with pytest.raises(ValueError, match="W_cap >= n_ctx"):
        draft_attention_ref(**{**case, "window": None})
    with pytest.raises(ValueError, match="n_ctx"):
        draft_attention_ref(**{**case, "n_ctx": [1, 2, 3]})
    with pytest.raises(ValueError, match="multiple"):
        draft_attention_ref(**{**case, "q": torch.randn(2, 4, 3, 16)})


@needs_triton
def test_kernel_rejects_a_ring_too_small_without_syncing():
    from splitflash.kernels.draft_attention import draft_attention_triton

    case, _, _ = make_case([5, 9], 8, 8, 4, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="W_cap 8 < 9"):  # device n_ctx: checked via the bound
        draft_attention_triton(**{**case, "window": 10}, max_ctx_len=9)
    with pytest.raises(ValueError, match="window 10 reads the last 9"):  # host n_ctx: exact
        draft_attention_triton(**{**case, "window": 10, "n_ctx": [5, 9]})
