"""L2 prefetch of a layer's first keys per split (kernels/kv_prefetch.py).

A prefetch has no result, so the kernel's TRACE mode writes the element offsets it would ask
L2 for. Oracle: the pages hold their own flat storage offsets as values, so looking a token
up through the page table with torch indexing (k_pages[page, slot, head, d]) gives the offset
the kernel must have computed; which tokens must be fetched follows the attention kernel's
split of each request (the first `keys` prefix keys of each split). With keys >= a split,
the prefetched tokens must cover the prefix exactly once: the splits partition it.
"""

from __future__ import annotations

import random

import pytest
import torch

from splitflash.kernels.tuning import SPLIT_ALIGN, next_pow2, plan_launch
from tests.unit.kernel_env import DEVICE, needs_triton


def _layout(kv_lens, page, kv_heads, dim, dtype, seed):
    """Head-major pages ([P, H_KV, S, D] storage, [P, S, H_KV, D] views as PagedKVCache
    holds them) in `dtype`, the same layout in fp32 holding each element's own storage
    offset (the oracle's lookup table: fp16 cannot hold the offsets), a shuffled table."""
    rng = random.Random(seed)
    need = [-(-n // page) for n in kv_lens]
    n_pages = sum(need) + 2
    numel = n_pages * kv_heads * page * dim
    assert numel < 2**24  # exact in fp32
    storage = torch.arange(numel, dtype=torch.float32).reshape(n_pages, kv_heads, page, dim)
    offsets = storage.transpose(1, 2)
    k_pages = storage.to(dtype).transpose(1, 2)
    v_pages = torch.zeros_like(storage, dtype=dtype).transpose(1, 2)
    order = list(range(n_pages))
    rng.shuffle(order)
    table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(order[used : used + n], dtype=torch.int32)
        used += n
    return k_pages, v_pages, table, offsets


def _expected(offsets, table, kv_len, q_len, n_splits, split, head, keys, line_elems, lines):
    """Storage offsets (K) of the lines of the first `keys` prefix keys of one split."""
    per_split = -(-kv_len // n_splits)
    split_len = -(-per_split // SPLIT_ALIGN) * SPLIT_ALIGN
    start = split * split_len
    end = min(start + split_len, start + keys, kv_len - q_len)
    page = offsets.shape[1]
    want, tokens = set(), set()
    for t in range(start, end):
        phys = int(table[t // page])
        tokens.add(t)
        for line in range(lines):
            d = line * line_elems
            if d < offsets.shape[3]:
                want.add(int(offsets[phys, t % page, head, d]))
    return want, tokens


def _traced(k_pages, v_pages, table, kv_lens, q_lens, group, keys):
    from splitflash.kernels.kv_prefetch import kv_prefetch_triton

    dev = dict(device=DEVICE)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, **dev)
    return kv_prefetch_triton(
        k_pages.to(**dev), v_pages.to(**dev), table.to(**dev),
        torch.tensor(kv_lens, dtype=torch.int32, **dev), cu_q, group=group,
        max_kv_len=max(kv_lens), max_q_len=max(q_lens), keys=keys, trace=True,
    ).cpu()  # fmt: skip


@needs_triton
@pytest.mark.parametrize(
    "kv_lens,q_lens,kv_heads,group,dim,page,keys,dtype",
    [
        ([1], [1], 1, 1, 64, 16, 128, torch.float32),
        ([13, 4097], [7, 16], 3, 3, 64, 16, 256, torch.float16),
        ([113, 700, 2000], [16, 1, 64], 2, 8, 32, 8, 128, torch.float32),
        ([1500], [16], 1, 4, 128, 32, 64, torch.float16),  # 2 lines per token in fp16
        ([5000, 64], [16, 64], 2, 1, 16, 16, 4096, torch.float32),  # keys >= a split
    ],
)
def test_prefetched_lines_are_the_first_keys_of_each_split(
    kv_lens, q_lens, kv_heads, group, dim, page, keys, dtype
):
    k_pages, v_pages, table, offsets = _layout(kv_lens, page, kv_heads, dim, dtype, len(kv_lens))
    trace = _traced(k_pages, v_pages, table, kv_lens, q_lens, group, keys)
    n_splits, n_req, n_heads, _, traced_keys, lines = trace.shape
    plan = plan_launch(torch.device(DEVICE), max(q_lens) * group, max(q_lens), len(kv_lens),
                       kv_heads, max(kv_lens))  # fmt: skip
    assert n_splits == plan.splits.num_splits and traced_keys == next_pow2(keys)
    line_elems = max(1, 128 // k_pages.element_size())
    whole_splits_seen = False
    for b, (kv_len, q_len) in enumerate(zip(kv_lens, q_lens, strict=True)):
        for h in range(n_heads):
            covered: list[int] = []
            for s in range(n_splits):
                want, tokens = _expected(offsets, table[b], kv_len, q_len, n_splits, s, h,
                                         traced_keys, line_elems, lines)  # fmt: skip
                got_k = trace[s, b, h, 0]
                got_v = trace[s, b, h, 1]
                assert set(got_k[got_k >= 0].tolist()) == want, (b, h, s)
                # V's pages share K's layout: the same offsets, into V's storage.
                assert set(got_v[got_v >= 0].tolist()) == want, (b, h, s)
                covered.extend(tokens)
            if traced_keys >= -(-kv_len // n_splits) + SPLIT_ALIGN:  # whole splits fetched
                assert sorted(covered) == list(range(kv_len - q_len)), (b, h)
                whole_splits_seen = True
    assert whole_splits_seen or keys < 4096  # the last case must reach the check


def test_prefetch_setting_parses_and_refuses(monkeypatch):
    from splitflash.kernels.kv_prefetch import DEFAULT_PREFETCH_KEYS, prefetch_keys_setting

    monkeypatch.delenv("SPLITFLASH_KV_PREFETCH", raising=False)
    assert prefetch_keys_setting() == DEFAULT_PREFETCH_KEYS
    monkeypatch.setenv("SPLITFLASH_KV_PREFETCH", "0")
    assert prefetch_keys_setting() == 0
    monkeypatch.setenv("SPLITFLASH_KV_PREFETCH", "300")
    assert prefetch_keys_setting() == 512
    for bad in ("many", "-4"):
        monkeypatch.setenv("SPLITFLASH_KV_PREFETCH", bad)
        with pytest.raises(ValueError, match="SPLITFLASH_KV_PREFETCH"):
            prefetch_keys_setting()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prefetch_changes_no_result_eager_or_graphed(monkeypatch):
    """A verify step at 20k keys with the prefetch on equals the step with it off, bit for
    bit, eagerly and replayed from a CUDA graph (the side stream forks and joins inside the
    capture)."""
    from splitflash.models.graphs import VerifyGraphs
    from splitflash.models.kv_cache import PagedKVCache
    from splitflash.services.verify.engine import TargetEngine
    from tests.conftest import tiny_model

    model = tiny_model().to("cuda")
    cfg, context, q = model.cfg, 20_000, 16
    cache = PagedKVCache(cfg.num_layers, context // 16 + 8, 16, cfg.num_kv_heads, cfg.head_dim,
                         device="cuda", scratch_pages=8)  # fmt: skip
    torch.manual_seed(1)
    cache.k.normal_()
    cache.v.normal_()
    engine = TargetEngine(model, cache, feature_layer_ids=(0,))
    cache.add("r")
    cache.reserve("r", context + q)
    cache.seq("r").length = context
    batch = engine._batch([("r", list(range(1, q + 1)), context)])
    outs = {}
    for keys in ("0", "512"):
        monkeypatch.setenv("SPLITFLASH_KV_PREFETCH", keys)
        model._backend = None  # the backend reads the setting when built
        assert model.backend.prefetch_keys == int(keys)
        eager = model(batch, cache, None, (0,))
        graphs = VerifyGraphs(model, cache, (1,))
        graphs.run(batch, (0,))  # capture
        replay = graphs.run(batch, (0,))
        assert graphs.replays == 2 and not graphs.failed
        outs[keys] = (eager.logits, eager.hidden, replay.logits, replay.hidden)
    for off, on in zip(outs["0"], outs["512"], strict=True):
        assert torch.equal(off, on)
