"""DFlash drafter: cached block drafting vs the dense-mask oracle, bounded reads, policy."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from splitflash.models.dflash import (
    AttentionBackend,
    DFlashDesyncError,
    LayerKV,
    block_attention,
)
from splitflash.models.dflash.cache import _context_rows
from splitflash.models.dflash.reference import reference_draft
from tests.unit.test_dflash_support import TOL, D, V, cfg_dict, feats, fill, make


@pytest.mark.parametrize("causal", [None, True])
@pytest.mark.parametrize("n_ctx", [0, 1, 5, 7, 8, 9, 26, 70])
def test_block_draft_matches_dense_reference(n_ctx, causal):
    drafter = make(cfg_dict(causal=causal))
    state, f = fill(drafter, n_ctx)
    out = drafter.draft(state, 7, n_ctx, 6)
    assert out.shape == (5, V)
    torch.testing.assert_close(out, reference_draft(drafter, f, 7, 6), **TOL)


def test_block_longer_than_window_and_smaller_block():
    drafter = make(cfg_dict(window=3, block=8))
    state, f = fill(drafter, 20)
    for b in (8, 4, 2):
        torch.testing.assert_close(
            drafter.draft(state, 3, 20, b), reference_draft(drafter, f, 3, b), **TOL
        )
    with pytest.raises(ValueError, match="block_size"):
        drafter.draft(state, 3, 20, 9)  # trained at B=8: never run larger


@pytest.mark.parametrize("mult", [1, 4, 16])
def test_sliding_reads_and_memory_bounded_by_window(mult):
    w = 8
    drafter = make(cfg_dict(window=w))
    state, f = fill(drafter, mult * w, chunks=[3] * (mult * w // 3) + [mult * w % 3])
    out = drafter.draft(state, 5, mult * w, 6)
    assert state.keys_read_last[:2] == [min(mult * w, w - 1)] * 2  # sliding layers
    assert state.keys_read_last[2] == mult * w  # the full layer reads everything
    assert state.keys_read_by_kind() == {"sliding": min(mult * w, w - 1), "full": mult * w}
    assert all(rows <= w for rows in state.cache_rows()[:2])
    torch.testing.assert_close(out, reference_draft(drafter, f, 5, 6), **TOL)


@pytest.mark.parametrize("seed", range(4))
def test_ring_wraparound_uneven_appends(seed):
    g = torch.Generator().manual_seed(seed)
    drafter = make(cfg_dict(window=5), seed=seed)
    state, f = drafter.new_state(), feats(300, seed)
    pos = 0
    while pos < 250:
        c = int(torch.randint(1, 13, (1,), generator=g))  # uneven, sometimes > window
        drafter.append_context(state, f[pos : pos + c], pos)
        pos += c
        tok = int(torch.randint(0, V, (1,), generator=g))
        torch.testing.assert_close(
            drafter.draft(state, tok, pos), reference_draft(drafter, f[:pos], tok, 6), **TOL
        )
    assert state.cache_rows()[:2] == [5, 5]


def test_full_attention_layers_match_reference():
    drafter = make(cfg_dict(layer_types=("full_attention",) * 2))
    assert [p.kind for p in drafter.policy_summary()] == ["full", "full"]
    state, f = fill(drafter, 40, chunks=[17, 1, 22])
    torch.testing.assert_close(
        drafter.draft(state, 11, 40), reference_draft(drafter, f, 11, 6), **TOL
    )
    assert state.keys_read_last == [40, 40]


def test_batched_draft_equals_single():
    drafter = make()
    states = [fill(drafter, n, seed=n)[0] for n in (3, 12, 30)]
    batch = drafter.draft_batch(states, [1, 2, 3], [3, 12, 30], 5)
    for i, (s, n) in enumerate(zip(states, (3, 12, 30), strict=True)):
        torch.testing.assert_close(batch[i], drafter.draft(s, i + 1, n, 5), **TOL)


def test_policy_summary_and_string():
    cfg = cfg_dict(layer_types=["sliding_attention"] * 5 + ["full_attention"], window=2048)
    cfg["dflash_config"]["target_layer_ids"] = [1, 2]
    drafter = make(cfg)
    assert [tuple(p) for p in drafter.policy_summary()] == (
        [(i, "sliding", 2048) for i in range(5)] + [(5, "full", None)]
    )
    assert drafter.policy_string().startswith("5 of 6 layers sliding (window 2048), 1 full")
    assert "non-causal" in drafter.policy_string()
    info = drafter.policy_info()
    assert info["sliding_layers"] == "5" and info["window"] == "2048"
    assert info["window_override"] == "checkpoint"


def test_window_override_off_is_loud_and_matches_unwindowed_reference():
    base = make()
    off = make(window_override="off")
    assert [p.kind for p in off.policy_summary()] == ["full_override", "full_override", "full"]
    assert "window_override=off" in off.policy_string()
    assert off.policy_string() != base.policy_string()
    assert off.policy_info()["sliding_layers"] == "0"
    state, f = fill(off, 30)
    out = off.draft(state, 4, 30)
    torch.testing.assert_close(out, reference_draft(off, f, 4, 6, windows=[None] * 3), **TOL)
    assert state.keys_read_last == [30, 30, 30]
    assert not torch.allclose(out, reference_draft(off, f, 4, 6), atol=1e-3)


def test_backend_that_cannot_bound_reads_is_refused_for_sliding_layers():
    unbounded = AttentionBackend("mask_after_qk", block_attention, bounds_window_reads=False)
    with pytest.raises(ValueError, match="cannot bound its reads"):
        make(attention_backend=unbounded)
    make(cfg_dict(layer_types=("full_attention",)), attention_backend=unbounded)
    make(attention_backend=unbounded, window_override="off")  # explicit experiment: allowed
    with pytest.raises(ValueError, match="window_override"):
        make(window_override="on")


def test_desync_is_loud():
    drafter = make()
    state, _ = fill(drafter, 10)
    with pytest.raises(DFlashDesyncError, match="expected start_pos == 10"):
        drafter.append_context(state, feats(2), 9)
    with pytest.raises(DFlashDesyncError, match="expected start_pos == 10"):
        drafter.append_context(state, feats(2), 12)
    with pytest.raises(DFlashDesyncError, match="anchor"):
        drafter.draft(state, 1, 11)
    with pytest.raises(DFlashDesyncError, match="another drafter"):
        make().draft(state, 1, 10)
    with pytest.raises(ValueError, match="features"):
        drafter.append_context(state, torch.zeros(2, D), 10)
    assert state.n_ctx == 10  # refused appends changed nothing


def test_bf16_runs_close_to_fp32():
    drafter = make()
    low = copy.deepcopy(drafter).to(torch.bfloat16)
    s32, f = fill(drafter, 12)
    s16 = low.new_state()
    low.append_context(s16, f, 0)
    out16 = low.draft(s16, 3, 12)
    assert out16.dtype == torch.float32  # logits in the shared head's dtype
    assert torch.isfinite(out16).all()
    torch.testing.assert_close(out16, drafter.draft(s32, 3, 12), atol=0.3, rtol=0.1)


@settings(max_examples=60, deadline=None)
@given(
    window=st.integers(1, 9),
    full=st.booleans(),
    chunks=st.lists(st.integers(1, 25), min_size=1, max_size=12),
)
def test_ring_buffer_rows_property(window, full, chunks):
    """After any append pattern the cache yields exactly the visible positions, in order."""
    w = None if full else window
    kv, pos = LayerKV(w, 1, 2, torch.float32, "cpu"), 0
    for c in chunks:
        rows = torch.arange(pos, pos + c, dtype=torch.float32)[:, None, None].expand(c, 1, 2)
        kv.write(rows, -rows, pos)
        pos += c
        k, v = _context_rows(kv.k, kv.v, pos, w)
        lo = 0 if w is None else max(0, pos - (w - 1))
        assert k[:, 0, 0].tolist() == [float(x) for x in range(lo, pos)]
        assert torch.equal(v, -k)
        assert w is None or kv.capacity <= w
