"""Context features of several requests written in one pass (DFlashDrafter.append_contexts),
and the proposer holding a step's features until its next proposal (DFlashProposer).

Oracle: the one-request path (`append_context` per item) on twin states, layer by layer,
through ring wrap-around, pooled states and a state that appears twice in one batch."""

from __future__ import annotations

import pytest
import torch

from splitflash.models.dflash import DFlashDesyncError
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.services.draft import dflash_drafter
from splitflash.services.draft.dflash_drafter import DFlashProposer
from tests.unit.test_dflash_support import feats, make

W = 8  # cfg_dict's window: layers 0, 1 sliding, layer 2 full
# The same rows, projected in a GEMM of another height: fp32 BLAS rounds them differently on
# some CPUs (1.1e-6 measured on an AMD EPYC). A wrong row or position differs by O(0.1).
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _same_caches(got, want) -> None:
    assert got.n_ctx == want.n_ctx
    for layer_got, layer_want in zip(got.layers, want.layers, strict=True):
        rows = got.n_ctx if layer_want.window is None else min(got.n_ctx, W)  # rows written
        torch.testing.assert_close(layer_got.k[:rows], layer_want.k[:rows], **TOL)
        torch.testing.assert_close(layer_got.v[:rows], layer_want.v[:rows], **TOL)


@pytest.mark.parametrize("pooled", [False, True])
def test_batched_appends_equal_one_by_one(pooled: bool) -> None:
    drafter = make()
    pool = DraftKVPool(drafter, slots=4, context=64) if pooled else None
    new = drafter.new_state if pool is None else pool.new_state
    batched, single = [new() for _ in range(3)], [new() for _ in range(3)]
    # Uneven chunks, past the window (ring wrap), and state 0 twice in one batch.
    plan = [[(0, 5), (5, 11)], [(0, 3)], [(0, 1)]], [[(16, 2)], [(3, 9)], [(1, 13)]]
    for step in plan:
        items = []
        for i, chunks in enumerate(step):
            for start, n in chunks:
                rows = feats(start + n, seed=i)[start:]
                items.append((batched[i], rows, start))
                drafter.append_context(single[i], rows, start)
        drafter.append_contexts(items)
        for got, want in zip(batched, single, strict=True):
            _same_caches(got, want)


def test_a_bad_item_is_refused_before_anything_is_written() -> None:
    drafter = make()
    a, b = drafter.new_state(), drafter.new_state()
    k_before = [layer.k.clone() for layer in a.layers]
    with pytest.raises(DFlashDesyncError, match="start at position 4 but the drafter holds 3"):
        drafter.append_contexts([(a, feats(3), 0), (b, feats(2), 0), (a, feats(2), 4)])
    with pytest.raises(ValueError, match=r"\[n, 128\]"):
        drafter.append_contexts([(a, feats(3), 0), (b, torch.zeros(2, 5), 0)])
    assert a.n_ctx == b.n_ctx == 0
    assert all(torch.equal(layer.k, k) for layer, k in zip(a.layers, k_before, strict=True))


def test_proposer_holds_features_until_it_proposes(monkeypatch) -> None:
    """Features are checked when they arrive and written in batched passes at the next
    proposal (FLUSH_ROWS small here: several passes); the drafts equal those of a drafter
    fed one append at a time."""
    monkeypatch.setattr(dflash_drafter, "FLUSH_ROWS", 7)
    drafter = make()
    prop = DFlashProposer(drafter)
    prompts = {"a": list(range(1, 12)), "b": list(range(20, 25)), "c": list(range(30, 33))}
    states, chunks = {}, {}
    for rid, ids in prompts.items():  # the oracle: one append per request, nothing held
        rows = feats(len(ids) - 1, seed=len(ids))
        states[rid] = drafter.new_state()
        drafter.append_context(states[rid], rows, 0)
        cut = min(4, len(rows))  # the prompt sent in chunks (c: one, then an empty one)
        chunks[rid] = [(0, rows[:cut]), (cut, rows[cut:])]
    calls = []
    real = drafter.append_contexts
    monkeypatch.setattr(drafter, "append_contexts", lambda items: calls.append(
        sum(f.shape[0] for _, f, _ in items)) or real(items))  # fmt: skip
    for rid, ids in prompts.items():
        prop.open(rid, ids)
        for start, rows in chunks[rid]:
            prop.add_features(rid, start, rows)
        assert prop.context_len(rid) == len(ids) - 1  # held, though not yet written
    with pytest.raises(DFlashDesyncError, match="start at position 9 but the drafter holds 10"):
        prop.add_features("a", 9, feats(1))  # a gap (here: an overlap) is refused at once
    with pytest.raises(ValueError, match=r"\[n, 128\]"):
        prop.add_features("b", 4, torch.zeros(1, 3))
    assert calls == []  # nothing written before a proposal
    got = prop.propose_batch(["a", "b", "c"], 4)
    # chunks a 4 + 6, b 4 + 0, c 2 + 0 rows in passes of <= 7 rows: [a4] [a6] [b4 b0 c2 c0]
    assert calls == [4, 6, 6]
    assert got == drafter.draft_batch(
        [states[r] for r in "abc"], [ids[-1] for ids in prompts.values()],
        [len(ids) - 1 for ids in prompts.values()], 5,
    ).argmax(-1).tolist()  # fmt: skip
    prop.release("c")
    assert prop.propose_batch(["a", "b"], 4) == got[:2] and calls == [4, 6, 6]


def test_rows_of_paused_steps_are_written_as_one_item() -> None:
    """Steps without a proposal (the speculation gate paused drafting) each leave a feature
    row or two pending; the next proposal writes each request's rows as one item (one cache
    write per layer, not one per step), and drafts as if they had been written step by step."""
    drafter = make()
    prop = DFlashProposer(drafter)
    ids = list(range(1, 40))
    rows = feats(len(ids) - 1, seed=3)
    oracle = drafter.new_state()
    prop.open("r", ids[:3])
    prop.add_features("r", 0, rows[:2])
    prop.propose("r", 4)  # the prompt's rows written
    cuts = [2, 3, 5, 6, 7, 9, 10, 13, 14, 15, 20, 21, 22, 30, 31, 38]  # uneven "steps"
    for lo, hi in zip(cuts, cuts[1:], strict=False):
        prop.extend("r", ids[lo + 1 : hi + 1], hi + 1)
        prop.add_features("r", lo, rows[lo:hi])
    calls = []
    real = drafter.append_contexts
    drafter.append_contexts = lambda items: calls.append(
        [(f.shape[0], start) for _, f, start in items]) or real(items)  # fmt: skip
    got = prop.propose("r", 4)
    assert calls == [[(36, 2)]]
    drafter.append_context(oracle, rows, 0)
    assert got == drafter.draft(oracle, ids[-1], len(ids) - 1, 5).argmax(-1).tolist()
    _same_caches(prop.requests["r"].cache, oracle)
