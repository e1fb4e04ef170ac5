"""The draft graph writes a step's context rows itself (graphs.py, graph_inputs.py): a
proposer with graphs must draft exactly what the eager proposer drafts and leave the same
caches, step after step (ring wrap-around, uneven commits, a prompt's rows, a full layer
outgrowing the pool), and the rows it writes must not go through the eager append. On CPU
the graphs run their static step without capture (capture=False)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitflash.models.dflash.graph_inputs import append_rows
from splitflash.models.dflash.graphs import DraftGraphs
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.services.draft.dflash_drafter import DFlashProposer
from tests.unit.kernel_env import CUDA, INTERPRET
from tests.unit.test_dflash_support import feats, make, shared

W, R = 8, 6  # cfg_dict: layers 0, 1 sliding at W = 8, layer 2 full; block size 6
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _count_eager_rows(drafter) -> list[int]:
    """Rows written by DFlashDrafter.append_contexts, call by call."""
    calls: list[int] = []
    inner = drafter.append_contexts

    def counted(items):
        calls.append(sum(f.shape[0] for _, f, _ in items))
        return inner(items)

    drafter.append_contexts = counted
    return calls


def _run(prop, prompts, commits, k=5):
    """Open every request, then per step: propose for all, commit commits[step][i] tokens
    of request i (their features next, request 0's in two chunks); returns every step's
    drafts."""
    drafts, tokens = [], {}
    for i, (rid, ids) in enumerate(prompts.items()):
        prop.open(rid, ids)
        prop.add_features(rid, 0, feats(len(ids) - 1, seed=10 + i))
        tokens[rid] = list(ids)
    rids = list(prompts)
    for step, counts in enumerate(commits):
        drafts.append(prop.propose_batch(rids, k))
        for i, (rid, c) in enumerate(zip(rids, counts, strict=True)):
            new = [(7 * step + 3 * i + j) % 50 + 1 for j in range(c)]
            held = prop.context_len(rid)
            tokens[rid] += new
            prop.extend(rid, new, len(tokens[rid]))
            rows = feats(c, seed=100 * step + i)  # positions held .. held + c - 1
            cut = c // 2 if i == 0 else 0  # request 0's rows arrive in two messages
            if cut:
                prop.add_features(rid, held, rows[:cut])
            prop.add_features(rid, held + cut, rows[cut:])
    drafts.append(prop.propose_batch(rids, k))
    return drafts


def _same_rows(graphed, plain, pool, rids) -> None:
    """Each request's rows in its pool slot equal the eager proposer's cache rows."""
    for rid in rids:
        st, ref = graphed.requests[rid].cache, plain.requests[rid].cache
        assert st.n_ctx == ref.n_ctx and not graphed.requests[rid].pending
        for li, win in enumerate((W, W, None)):
            if st.layers[li].pool_slot is None:  # moved out of the pool: its own buffer
                k, v = st.layers[li].k, st.layers[li].v
            else:
                k, v = pool.k[li][st.pool_slot], pool.v[li][st.pool_slot]
            pos = torch.arange(max(0, st.n_ctx - (win or st.n_ctx)), st.n_ctx)
            idx = pos % win if win else pos
            torch.testing.assert_close(k[idx], ref.layers[li].k[idx], **TOL)
            torch.testing.assert_close(v[idx], ref.layers[li].v[idx], **TOL)


def _proposers(pool_context: int):
    plain_d, graph_d = make(), make()
    pool = DraftKVPool(graph_d, slots=4, context=pool_context)
    graphed = DFlashProposer(graph_d, pool, DraftGraphs(graph_d, pool, capture=False))
    return DFlashProposer(plain_d), graphed, pool, _count_eager_rows(graph_d)


def test_graph_written_rows_draft_and_cache_what_eager_does():
    prompts = {"a": list(range(1, 12)), "b": list(range(20, 25)), "c": [3, 4]}
    commits = [[1, 6, 3], [6, 1, 2], [4, 4, 6], [2, 5, 1], [6, 6, 6]]  # past W: rings wrap
    plain, graphed, pool, eager_rows = _proposers(pool_context=64)
    assert _run(graphed, prompts, commits) == _run(plain, prompts, commits)
    assert graphed.pop_forwards() == {"graph": len(commits) + 1, "eager": 0}
    assert eager_rows == [10]  # only a's prompt rows (> R); b's 4 and c's 1 were graphed
    _same_rows(graphed, plain, pool, prompts)
    assert [graphed.requests[r].cache.pool_slot for r in prompts] == [1, 2, 3]


def test_a_full_layer_outgrowing_the_pool_falls_back_to_eager_writes():
    prompts = {"a": list(range(1, 12)), "b": [5, 6, 7]}
    commits = [[3, 2], [6, 6]]  # a: 10 + 3 + 6 rows > the pool's 16
    plain, graphed, pool, eager_rows = _proposers(pool_context=16)
    assert _run(graphed, prompts, commits) == _run(plain, prompts, commits)
    # a's prompt (10 rows > R) went eager; the last step could not be graphed (a's rows
    # would pass the pool's 16): its rows and b's went eager, and so did the draft.
    assert eager_rows == [10, 6 + 6]
    assert graphed.pop_forwards() == {"graph": 2, "eager": 1}
    assert graphed.requests["a"].cache.layers[2].pool_slot is None
    _same_rows(graphed, plain, pool, prompts)


def test_append_rows_destinations():
    drafter = make()
    pool = DraftKVPool(drafter, slots=3, context=40)
    # Request 0 in slot 2 writes positions 13..15, request 1 (slot 1) nothing; N_pad 3, R 4.
    app_pos, app_dest, feat_rows = append_rows(pool, [2, 1], [13, 9], [3, 0], n_pad=3, rows=4)
    assert app_pos.tolist() == [13, 14, 15, 0] + [0] * 8
    assert feat_rows.tolist() == [0, 1, 2]
    pos = np.array([13, 14, 15])
    for li, cap in enumerate((W, W, 40)):
        want = 2 * cap + (pos % W if cap == W else pos)
        assert app_dest[li, :3].tolist() == want.tolist()
        unused = np.delete(app_dest[li], [0, 1, 2])
        assert (unused < cap).all()  # scratch slot 0 only
    assert len(set(app_dest[2, 3:].tolist())) == 9  # distinct scratch rows where they fit
    assert append_rows(pool, [1], [0], [5], n_pad=1, rows=4) is None  # more than R rows
    assert append_rows(pool, [1], [38], [3], n_pad=1, rows=4) is None  # past the pool
    small_w = DraftKVPool(make(), slots=1, context=40)
    assert append_rows(small_w, [1], [0], [W + 1], n_pad=1, rows=W + 2) is None  # ring collides


def _append_rows_by_loop(pool, slots, starts, counts, n_pad, rows):
    """append_rows' contract written out request by request and layer by layer: the oracle
    of its vectorised form (unused rows are only checked to lie on scratch slot 0)."""
    caps = [k.shape[1] for k in pool.k]
    app_pos = np.zeros(n_pad * rows, dtype=np.int64)
    app_dest = np.full((len(caps), n_pad * rows), -1, dtype=np.int64)  # -1: scratch
    feat_rows = []
    for i, (slot, start, n) in enumerate(zip(slots, starts, counts, strict=True)):
        for li, (cap, win) in enumerate(zip(caps, pool.windows, strict=True)):
            too_many = n > rows or (n > win if win is not None else start + n > cap)
            if n and too_many:
                return None
            for r in range(n):
                app_dest[li, i * rows + r] = slot * cap + ((start + r) % win if win else start + r)
        for r in range(n):
            app_pos[i * rows + r] = start + r
            feat_rows.append(i * rows + r)
    return app_pos, app_dest, feat_rows


def test_append_rows_matches_a_loop_over_requests_and_layers():
    pool = DraftKVPool(make(), slots=5, context=40)
    caps = np.array([k.shape[1] for k in pool.k])[:, None]
    gen = np.random.default_rng(0)
    outcomes = set()
    for _ in range(300):
        n = int(gen.integers(1, 6))
        n_pad, rows = n + int(gen.integers(0, 3)), int(gen.integers(1, 10))
        slots = gen.permutation(np.arange(1, 6))[:n].tolist()
        starts = gen.integers(0, 42, n).tolist()
        counts = gen.integers(0, 11, n).tolist()
        want = _append_rows_by_loop(pool, slots, starts, counts, n_pad, rows)
        got = append_rows(pool, slots, starts, counts, n_pad, rows)
        outcomes.add(want is None)
        if want is None:
            assert got is None
            continue
        assert got is not None
        assert got[0].tolist() == want[0].tolist()
        assert got[2].tolist() == want[2]
        scratch = want[1] == -1
        assert (got[1][~scratch] == want[1][~scratch]).all()
        assert (got[1] < np.broadcast_to(caps, got[1].shape))[scratch].all()  # slot 0's rows
    assert outcomes == {True, False}  # both the graphable and the refused cases came up


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU, TRITON_INTERPRET unset")
def test_captured_graph_writes_rows_and_drafts_what_eager_does():
    """The same oracle with real CUDA graphs: the appends are captured inside the step."""

    def on_gpu():
        drafter = make().cuda()
        emb, head = shared(0)
        drafter.attach_shared(torch.nn.Embedding.from_pretrained(emb.weight.cuda()), head.cuda())
        return drafter

    plain_d, graph_d = on_gpu(), on_gpu()
    pool = DraftKVPool(graph_d, slots=4, context=64)
    graphs = DraftGraphs(graph_d, pool, batch_sizes=(1, 4))
    graphed, plain = DFlashProposer(graph_d, pool, graphs), DFlashProposer(plain_d)
    prompts = {"a": list(range(1, 12)), "b": list(range(20, 25)), "c": [3, 4]}
    commits = [[1, 6, 3], [6, 1, 2], [4, 4, 6], [2, 5, 1], [6, 6, 6]]
    assert _run(graphed, prompts, commits) == _run(plain, prompts, commits)
    assert graphs.captures == 1 and not graphs.failed
    assert next(iter(graphs._graphs.values())).graph is not None
    _same_rows(graphed, plain, pool, prompts)
