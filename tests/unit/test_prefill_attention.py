"""The prefill attention path (blocks longer than 64: `causal_attention_torch`) against a
plain fp64 softmax reference, and on the GPU its memory: it must not materialise the
[T, T] scores (the math SDPA kernel did: a 185k-token prompt asked for 127.5 GiB)."""

from __future__ import annotations

import pytest
import torch

from splitflash.models.attention import AttentionMeta, causal_attention_torch


def _case(q_len: int, kv_len: int, heads: int, kv_heads: int, dim: int, page: int, device):
    g = torch.Generator().manual_seed(q_len * 7 + kv_len)
    n_pages = -(-kv_len // page)
    k = torch.randn(n_pages + 3, page, kv_heads, dim, generator=g)
    v = torch.randn(n_pages + 3, page, kv_heads, dim, generator=g)
    table = torch.randperm(n_pages + 3, generator=g)[:n_pages].to(torch.int32)[None]
    q = torch.randn(q_len, heads, dim, generator=g)
    meta = AttentionMeta(
        cu_q=torch.tensor([0, q_len], dtype=torch.int32), kv_lens=torch.tensor([kv_len]),
        page_table=table, anc_bits=None, q_lens=[q_len], kv_lens_list=[kv_len],
    )  # fmt: skip
    to = lambda t: t.to(device)  # noqa: E731
    meta.cu_q, meta.kv_lens, meta.page_table = map(to, (meta.cu_q, meta.kv_lens, table))
    return to(q), to(k), to(v), meta


def _reference(q, k_pages, v_pages, table, kv_len):
    """fp64 softmax attention; query i sits at position kv_len - q_len + i."""
    q_len, heads, dim = q.shape
    idx = table[0].long()
    k = k_pages[idx].reshape(-1, *k_pages.shape[2:])[:kv_len].double()
    v = v_pages[idx].reshape(-1, *v_pages.shape[2:])[:kv_len].double()
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * dim**-0.5
    pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    s = s.masked_fill(torch.arange(kv_len)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("q_len,kv_len", [(65, 65), (100, 100), (70, 113), (97, 4097)])
def test_prefill_attention_matches_fp64(q_len, kv_len):
    q, k, v, meta = _case(q_len, kv_len, heads=6, kv_heads=2, dim=16, page=16, device="cpu")
    got = causal_attention_torch(q, k, v, meta, 16**-0.5)
    want = _reference(q, k, v, meta.page_table, kv_len)
    assert (got.double() - want).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t,kv", [(32768, 32768), (8192, 40960)], ids=["prompt", "chunk"])
def test_prefill_attention_memory_is_linear_in_the_prompt(t, kv):
    # The math kernel's scores alone: 9 heads x t x kv x 2 bytes = 19 GB / 6 GB. "chunk": a
    # prompt's last chunk after the cached ones (bottom-right causal, TargetEngine.prefill).
    q, k, v, meta = _case(t, kv, heads=9, kv_heads=3, dim=64, page=16, device="cuda")
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = causal_attention_torch(q, k, v, meta, 64**-0.5)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 1 << 30, f"prefill attention of {t} tokens took {extra / 2**30:.1f} GiB extra"
    # The last 64 queries (positions kv-64 .. kv-1) against the fp64 reference, on the host.
    want = _reference(q[-64:].cpu(), k.cpu(), v.cpu(), meta.page_table.cpu(), kv)
    assert (out[-64:].cpu().double() - want).abs().max() < 2e-2
