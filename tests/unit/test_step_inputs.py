"""One-copy step inputs (models/step_inputs.py) against the tensors built one by one from the
KV cache's own lookups (slots, page table) and attention.causal_bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitflash.models.attention import causal_bits
from splitflash.models.config import TargetConfig
from splitflash.models.kv_cache import PagedKVCache
from splitflash.models.step_inputs import StepHost, pack, upload, views
from splitflash.models.target import TargetModel
from splitflash.services.verify.engine import TargetEngine

CFG = TargetConfig(family="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                   num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)  # fmt: skip


def _engine(page_size: int = 4) -> TargetEngine:
    cache = PagedKVCache(1, 256, page_size, 1, 8, scratch_pages=16)
    return TargetEngine(TargetModel(CFG), cache)


def _reserve(engine, spans):
    """Random page placement: pages handed out after others were taken and given back."""
    cache = engine.cache
    cache.add("junk")
    cache.reserve("junk", 37)
    for rid, toks, start in spans:
        cache.add(rid)
        cache.reserve(rid, start + len(toks))
    cache.free("junk")


@pytest.mark.parametrize(
    "spans",
    [
        [("a", [5, 6, 7], 10)],
        [("a", [1] * 16, 0), ("b", [2] * 7, 13), ("c", [3], 1)],
        [("a", list(range(64)), 3), ("b", [9] * 64, 130)],
        [("p", list(range(100)), 0)],  # a prefill block: causal, no ancestor bits
        [("p", list(range(70)), 5), ("q", [4, 4], 60)],
    ],
)
def test_upload_equals_tensors_built_one_by_one(spans):
    engine = _engine()
    _reserve(engine, spans)
    cache = engine.cache
    got = engine._batch(spans)
    q_lens = [len(t) for _, t, _ in spans]
    kv_lens = [s + len(t) for _, t, s in spans]
    want_ids = torch.tensor([t for _, toks, _ in spans for t in toks])
    want_pos = torch.cat([torch.arange(s, s + len(t)) for _, t, s in spans])
    want_slots = torch.cat([cache.slots(r, s, s + len(t)) for r, t, s in spans])
    table = cache.page_table([r for r, _, _ in spans], "cpu")  # all pages of each request
    assert torch.equal(got.token_ids, want_ids)
    assert torch.equal(got.positions, want_pos)
    assert torch.equal(got.slots, want_slots)
    assert got.token_ids.dtype == got.slots.dtype == torch.int64
    m = got.meta
    assert m.cu_q.tolist() == np.cumsum([0] + q_lens).tolist() and m.cu_q.dtype == torch.int32
    assert m.kv_lens.tolist() == kv_lens and m.kv_lens.dtype == torch.int32
    assert m.q_lens == q_lens and m.kv_bound is None
    assert m.kv_lens_list == kv_lens and all(type(x) is int for x in m.kv_lens_list)
    for r, kv in enumerate(kv_lens):  # the pages that hold kv_len keys; zeros past them
        used = cache.pages_for(kv)
        assert torch.equal(m.page_table[r, :used], table[r, :used])
        assert not m.page_table[r, used:].any()
    if max(q_lens) <= 64:
        assert torch.equal(m.anc_bits, causal_bits(q_lens))
    else:
        assert m.anc_bits is None


def test_padding_appends_dummies_on_the_scratch_pages():
    engine = _engine()
    spans = [("a", [7] * 5, 9), ("b", [8] * 5, 30)]
    _reserve(engine, spans)
    step = engine._step_host(spans)
    pad_pages = np.asarray(engine.cache.scratch_page_ids[:2], dtype=np.int32)
    pad_slots = np.array([pad_pages[p // 4] * 4 + p % 4 for p in range(8)], dtype=np.int64)
    padded = step.padded(4, pad_slots, pad_pages)
    width = engine.cache.pages_for(64)
    got = views(pack(padded, width, pin=False), [5] * 4, [64] * 4, width, kv_bound=64)
    real = engine._batch(spans)
    assert torch.equal(got.token_ids[:10], real.token_ids) and not got.token_ids[10:].any()
    assert got.positions[10:].tolist() == [0, 1, 2, 3, 4] * 2
    assert got.slots[10:].tolist() == pad_slots[:5].tolist() * 2
    assert got.meta.kv_lens.tolist() == [14, 35, 5, 5]
    assert got.meta.page_table[2:, :2].tolist() == [pad_pages.tolist()] * 2
    assert torch.equal(got.meta.anc_bits, causal_bits([5] * 4))
    assert got.meta.kv_bound == 64
    assert step.padded(2, pad_slots, pad_pages) is step  # nothing to pad


def test_a_row_wider_than_the_table_is_refused():
    row = np.arange(5, dtype=np.int32)
    step = StepHost(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.int64),
                    [1], [17], [row])  # fmt: skip
    with pytest.raises(ValueError, match="row 0 has 5 pages, the width is 4"):
        pack(step, 4, pin=False)
    assert upload(step, torch.device("cpu")).meta.page_table.tolist() == [row.tolist()]


def test_a_span_past_its_reserved_kv_is_refused():
    engine = _engine()
    _reserve(engine, [("a", [1] * 4, 3)])  # 7 tokens reserved: two pages of 4
    with pytest.raises(ValueError, match="KV for 9 tokens is not reserved"):
        engine._step_host([("a", [1] * 6, 3)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_pinned_copy_to_the_gpu_equals_the_host_buffer():
    engine = _engine()
    spans = [("a", [1] * 16, 0), ("b", [2] * 7, 13), ("c", [3], 1)]
    _reserve(engine, spans)
    for i in range(3):  # pinned blocks are reused: each copy must carry its own step's ids
        step = engine._step_host([(r, [t + 10 * i for t in toks], s) for r, toks, s in spans])
        host, dev = upload(step, torch.device("cpu")), upload(step, torch.device("cuda"))
        for name in ("token_ids", "positions", "slots"):
            assert torch.equal(getattr(dev, name).cpu(), getattr(host, name)), name
        for name in ("cu_q", "kv_lens", "page_table", "anc_bits"):
            assert torch.equal(getattr(dev.meta, name).cpu(), getattr(host.meta, name)), name


def test_chain_bits_against_python_ints():
    # The independent formula: node i of a chain sees nodes 0..i, bit 63 as int64's sign.
    q_lens = [1, 7, 63, 64, 16]
    want = [(1 << (i + 1)) - 1 if i < 63 else -1 for q in q_lens for i in range(q)]
    assert causal_bits(q_lens).tolist() == want
