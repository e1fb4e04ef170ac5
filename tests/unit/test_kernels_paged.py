"""Paged verify attention: Triton kernel vs torch reference vs a naive fp64 dense-mask oracle.

Kernel tests run under TRITON_INTERPRET=1 on CPU (fp32, fp16) or natively on CUDA; the bf16
variants need a real GPU. Accuracy criterion (DESIGN.md 9):
err(kernel vs fp64) <= 2 * err(torch low-precision reference vs fp64) + atol.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitflash.kernels.paged_attention_ref import paged_attention_ref
from tests.unit.kernel_env import ATOL, DEVICE, needs_gpu, needs_triton


def ancestor_bits(parents: list[int]) -> list[int]:
    """parents[i] < i (parents[0] = -1) -> int64 ancestor-or-self bitmasks."""
    bits: list[int] = []
    for i, p in enumerate(parents):
        bits.append((1 << i) | (bits[p] if p >= 0 else 0))
    return [b - (1 << 64) if b >= 1 << 63 else b for b in bits]  # two's complement int64


def random_parents(rng: random.Random, n: int, chain: bool) -> list[int]:
    return [i - 1 if chain else rng.randrange(i) if i else -1 for i in range(n)]


def make_case(kv_lens, q_lens, heads, kv_heads, dim, page, dtype, seed=0, chain=False,
              head_major=False):  # fmt: skip
    """Random paged batch. Pages are handed out in a shuffled order (plus spare pages) so
    a kernel ignoring the page table cannot pass. head_major: pages stored [P, H_KV, S, D]
    and passed as [P, S, H_KV, D] views, as PagedKVCache holds them."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // page) for n in kv_lens]
    n_pages = sum(need) + 3
    k_pages = torch.randn(n_pages, page, kv_heads, dim, generator=gen)
    v_pages = torch.randn(n_pages, page, kv_heads, dim, generator=gen)
    order = torch.randperm(n_pages, generator=gen)
    page_table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        page_table[b, :n] = order[used : used + n].int()
        used += n
    cu_q = torch.tensor([0] + [sum(q_lens[: i + 1]) for i in range(len(q_lens))], dtype=torch.int32)
    q = torch.randn(int(cu_q[-1]), heads, dim, generator=gen)
    anc = [a for n in q_lens for a in ancestor_bits(random_parents(rng, n, chain))]
    to = dict(device=DEVICE)
    if head_major:
        k_pages, v_pages = (t.transpose(1, 2).contiguous().transpose(1, 2)
                            for t in (k_pages, v_pages))  # fmt: skip
    return dict(
        q=q.to(dtype=dtype, **to),
        k_pages=k_pages.to(dtype=dtype, **to),
        v_pages=v_pages.to(dtype=dtype, **to),
        page_table=page_table.to(**to),
        kv_lens=torch.tensor(kv_lens, dtype=torch.int32, device=DEVICE),
        cu_q=cu_q.to(**to),
        anc_bits=torch.tensor(anc, dtype=torch.int64, device=DEVICE),
        scale=dim**-0.5,
    )


def as_fp64(case):
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in case.items()}  # fmt: skip


def dense_oracle(case) -> torch.Tensor:
    """fp64, per token gather, full [q_len, kv_len] mask: independent of the reference."""
    c = {k: v.cpu() if torch.is_tensor(v) else v for k, v in as_fp64(case).items()}
    q, kp, vp = c["q"], c["k_pages"], c["v_pages"]
    group = q.shape[1] // kp.shape[2]
    out = torch.zeros_like(q)
    cu = c["cu_q"].tolist()
    for b, kv_len in enumerate(c["kv_lens"].tolist()):
        q_len = cu[b + 1] - cu[b]
        t = torch.arange(kv_len)
        pages = c["page_table"][b].long()[t // kp.shape[1]]
        k = kp[pages, t % kp.shape[1]].repeat_interleave(group, dim=1)  # [L, H, D]
        v = vp[pages, t % kp.shape[1]].repeat_interleave(group, dim=1)
        mask = torch.ones(q_len, kv_len, dtype=torch.bool)
        for i in range(q_len):
            bits = int(c["anc_bits"][cu[b] + i]) & ((1 << 64) - 1)
            for j in range(q_len):
                mask[i, kv_len - q_len + j] = bool(bits >> j & 1)
        s = torch.einsum("qhd,khd->hqk", q[cu[b] : cu[b + 1]], k) * c["scale"]
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        out[cu[b] : cu[b + 1]] = torch.einsum("hqk,khd->qhd", p, v)
    return out


# (kv_lens, q_lens, H, H_KV, D, page size, forced splits or None)
CASES = [
    ([1], [1], 4, 4, 32, 1, None),
    ([13], [7], 6, 2, 32, 16, None),
    ([13, 1], [1, 1], 8, 1, 16, 16, None),
    ([113], [16], 3, 1, 32, 64, 1),
    ([113, 70], [64, 7], 6, 2, 16, 16, None),
    ([300, 64, 13], [7, 64, 1], 16, 2, 16, 1, 3),
    ([4097], [1], 8, 1, 16, 64, None),
    ([4097], [16], 3, 1, 16, 16, None),
    ([4097, 129], [64, 16], 2, 2, 16, 64, 5),
]
IDS = [f"kv{c[0]}-q{c[1]}-g{c[2] // c[3]}-p{c[5]}-s{c[6]}" for c in CASES]


def check_against_oracle(case, dtype, **kw):
    from splitflash.kernels.paged_attention import paged_attention_triton

    want = dense_oracle(case)
    got = paged_attention_triton(**case, **kw)
    assert got.dtype == dtype and got.shape == case["q"].shape
    low = paged_attention_ref(**case)
    err_kernel = (got.double().cpu() - want).abs().max().item()
    err_low = (low.double().cpu() - want).abs().max().item()
    assert err_kernel <= 2 * err_low + ATOL[dtype], (err_kernel, err_low)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kv_lens,q_lens,heads,kv_heads,dim,page,splits", CASES, ids=IDS)
def test_kernel_matches_oracle(kv_lens, q_lens, heads, kv_heads, dim, page, splits, dtype):
    case = make_case(kv_lens, q_lens, heads, kv_heads, dim, page, dtype, seed=len(kv_lens) + page)
    check_against_oracle(case, dtype, num_splits=splits)


HEAD_MAJOR = [([300, 13], [16, 1], 9, 3, 64, 16, 3), ([4097], [7], 6, 2, 16, 16, None)]


@needs_triton
@pytest.mark.parametrize("kv_lens,q_lens,heads,kv_heads,dim,page,splits", HEAD_MAJOR)
def test_kernel_reads_head_major_pages(kv_lens, q_lens, heads, kv_heads, dim, page, splits):
    case = make_case(kv_lens, q_lens, heads, kv_heads, dim, page, torch.float32, seed=5,
                     head_major=True)  # fmt: skip
    assert not case["k_pages"].is_contiguous() and case["k_pages"].stride(3) == 1
    check_against_oracle(case, torch.float32, num_splits=splits)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_lens,q_lens,heads,kv_heads,dim,page,splits", HEAD_MAJOR)
def test_kernel_reads_head_major_pages_bf16_gpu(kv_lens, q_lens, heads, kv_heads, dim, page,
                                                splits):  # fmt: skip
    case = make_case(kv_lens, q_lens, heads, kv_heads, dim, page, torch.bfloat16, seed=5,
                     head_major=True)  # fmt: skip
    check_against_oracle(case, torch.bfloat16, num_splits=splits)


@needs_triton
def test_kernel_planned_for_a_longer_bound_matches_oracle():
    # A CUDA graph plans its splits for its KV bucket (up to 2x the real lengths): every
    # request then spreads its own keys over all the splits, the short one too.
    case = make_case([1000, 70], [16, 7], 6, 2, 16, 16, torch.float32, seed=9)
    check_against_oracle(case, torch.float32, max_kv_len=2048, max_q_len=16)


@needs_triton
def test_kernel_causal_chain_of_64_uses_bit_63():
    case = make_case([200], [64], 2, 1, 16, 16, torch.float32, chain=True)
    assert int(case["anc_bits"][-1]) == -1  # all 64 bits set
    check_against_oracle(case, torch.float32, num_splits=2)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kv_lens,q_lens,heads,kv_heads,dim,page,splits", CASES, ids=IDS)
def test_kernel_matches_oracle_bf16_gpu(kv_lens, q_lens, heads, kv_heads, dim, page, splits):
    case = make_case(kv_lens, q_lens, heads, kv_heads, dim, page, torch.bfloat16, seed=1)
    check_against_oracle(case, torch.bfloat16, num_splits=splits)
    # Default split heuristic as well (the real SM count decides there).
    check_against_oracle(case, torch.bfloat16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("q_lens", [[16], [1, 1]], ids=["q16", "q1x2"])
def test_every_hopper_config_matches_oracle_at_64_dim_heads_bf16_gpu(q_lens):
    # The default model's heads (9 / 3 of 64): every tile config the autotuner or a measured
    # pick may launch there, 128-key tiles included, with a partial last tile.
    from splitflash.kernels.tuning import HOPPER_CONFIGS

    kv_lens = [4097, 1000][: len(q_lens)]
    case = make_case(kv_lens, q_lens, 9, 3, 64, 16, torch.bfloat16, seed=3, head_major=True)
    for config in HOPPER_CONFIGS:
        check_against_oracle(case, torch.bfloat16, config=config, num_splits=3)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    n_req=st.integers(1, 3),
    group=st.sampled_from([1, 3, 8]),
    page=st.sampled_from([1, 16, 64]),
)
def test_reference_matches_dense_oracle(data, n_req, group, page):
    q_lens = [data.draw(st.integers(1, 64)) for _ in range(n_req)]
    kv_lens = [q + data.draw(st.integers(0, 150)) for q in q_lens]
    case = make_case(kv_lens, q_lens, group * 2, 2, 16, page, torch.float64,
                     seed=data.draw(st.integers(0, 2**16)))  # fmt: skip
    got = paged_attention_ref(**{k: v.cpu() if torch.is_tensor(v) else v for k, v in case.items()})
    torch.testing.assert_close(got, dense_oracle(case), rtol=1e-10, atol=1e-10)


def test_reference_rejects_bad_input():
    case = {k: v.cpu() if torch.is_tensor(v) else v for k, v in
            make_case([13], [7], 4, 2, 16, 16, torch.float32).items()}  # fmt: skip
    with pytest.raises(ValueError, match="multiple"):
        paged_attention_ref(**{**case, "q": torch.randn(7, 3, 16)})
    with pytest.raises(ValueError, match="anc_bits"):
        paged_attention_ref(**{**case, "anc_bits": case["anc_bits"].int()})
    with pytest.raises(ValueError, match="kv_len"):
        paged_attention_ref(**{**case, "kv_lens": torch.tensor([5], dtype=torch.int32)})


@needs_triton
def test_dispatcher_forced_triton_logs_choice(monkeypatch, caplog):
    from splitflash.kernels import dispatch

    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    dispatch._announce.cache_clear()
    case = make_case([113], [7], 4, 2, 16, 16, torch.float32)
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        got = dispatch.paged_attention(**case)
    assert any("triton" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(got, paged_attention_ref(**case), rtol=1e-4, atol=1e-5)


def test_dispatcher_uses_reference_on_cpu(monkeypatch, caplog):
    from splitflash.kernels import dispatch

    monkeypatch.delenv("SPLITFLASH_FORCE_TRITON", raising=False)
    dispatch._announce.cache_clear()
    case = {k: v.cpu() if torch.is_tensor(v) else v for k, v in
            make_case([13], [1], 4, 2, 16, 16, torch.float32).items()}  # fmt: skip
    with caplog.at_level(logging.INFO, logger="splitflash.kernels"):
        got = dispatch.paged_attention(**case)
    assert any("reference" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(got, paged_attention_ref(**case))
