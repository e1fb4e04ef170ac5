"""The draft KV pool (one attention call per layer for a batch) and the draft step's CUDA
graphs: both must give the per-request eager `draft_batch`'s logits and key counts exactly,
through padding, ring wrap-around, a full layer outgrowing the pool, a full pool, and slot
reuse. On CPU the graphs run their padded static step without capture (capture=False); the
GPU test replays real graphs."""

from __future__ import annotations

import pytest
import torch

from splitflash.models.dflash.cache import TORCH_ATTENTION, TRITON_ATTENTION
from splitflash.models.dflash.graphs import DraftGraphs
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.services.draft.dflash_drafter import STAGE_ROWS, DFlashProposer
from tests.unit.kernel_env import CUDA, INTERPRET, needs_triton
from tests.unit.test_dflash_support import cfg_dict, feats, make, shared

W = 8  # cfg_dict's window: layers 0, 1 sliding, layer 2 full
TOL = {"atol": 1e-5, "rtol": 1e-5}


def grow(drafter, states, lengths, start):
    """Append features so state i holds lengths[i] tokens (from `start[i]`)."""
    for i, (state, n) in enumerate(zip(states, lengths, strict=True)):
        if n > state.n_ctx:
            f = feats(n, seed=i)
            drafter.append_context(state, f[state.n_ctx : n], state.n_ctx)
        start[i] = n


def twin_states(drafter, pool, n):
    """n eager (unpooled) states and n pooled ones."""
    return [drafter.new_state() for _ in range(n)], [pool.new_state() for _ in range(n)]


def test_pooled_batch_equals_per_request_attention():
    drafter = make()
    pool = DraftKVPool(drafter, slots=6, context=64)
    eager, pooled = twin_states(drafter, pool, 5)
    assert [s.pool_slot for s in pooled] == [1, 2, 3, 4, 5]  # slot 0 is scratch
    lengths = [0, 3, W - 1, W + 1, 5 * W + 3]  # empty, short, at and past the window (wrapped)
    for states in (eager, pooled):
        grow(drafter, states, lengths, [0] * 5)
    anchors = [3, 7, 11, 13, 17]
    for t in (6, 3):  # trained block and a shorter one
        want = drafter.draft_batch(eager, anchors, lengths, t)
        got = drafter.draft_batch(pooled, anchors, lengths, t, pool=pool)
        torch.testing.assert_close(got, want, **TOL)
        assert [s.keys_read_last for s in pooled] == [s.keys_read_last for s in eager]
    assert pooled[-1].keys_read_last == [W - 1, W - 1, 5 * W + 3]
    # The pool's rows are what the unpooled caches hold, slot by slot (ring positions too).
    for li in range(3):
        rows = eager[-1].layers[li].k.shape[0]
        torch.testing.assert_close(pool.k[li][5, :rows], eager[-1].layers[li].k, rtol=0, atol=0)


def test_graph_steps_equal_eager_steps_with_padding():
    drafter = make()
    pool = DraftKVPool(drafter, slots=8, context=128)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(1, 2, 4), capture=False)
    eager, pooled = twin_states(drafter, pool, 3)
    lengths, marks = [2, W, 3 * W + 1], [[0] * 3, [0] * 3]
    for step in range(4):  # contexts grow between steps, as committed tokens arrive
        lengths = [n + 3 * step for n in lengths]
        grow(drafter, eager, lengths, marks[0])
        grow(drafter, pooled, lengths, marks[1])
        for n_req in (3, 1):  # 3 real rows + 1 padding row, then batch 1
            anchors = [5 + step, 9, 21][:n_req]
            want = drafter.draft_batch(eager[:n_req], anchors, lengths[:n_req], 6)
            got = graphs.run(pooled[:n_req], anchors, lengths[:n_req], 6)
            torch.testing.assert_close(got, want, **TOL)
            assert [s.keys_read_last for s in pooled[:n_req]] == [
                s.keys_read_last for s in eager[:n_req]]  # fmt: skip
    # keys (N_pad, T, bucket): kv_bucket gives 256 here, capped at the pool's 128 rows
    assert graphs.replays == 8 and graphs.captures == 2
    assert set(graphs._graphs) == {(4, 6, 128), (1, 6, 128)}  # bucket capped at the pool
    # Padding rows read only the scratch slot and write nothing: the real slots are intact.
    for li in range(3):
        torch.testing.assert_close(pool.k[li][1, : W if li < 2 else lengths[0]],
                                   eager[0].layers[li].k[: W if li < 2 else lengths[0]],
                                   rtol=0, atol=0)  # fmt: skip


def test_greedy_steps_return_the_argmax_of_the_logits_and_keep_them_intact():
    drafter = make()
    pool = DraftKVPool(drafter, slots=4, context=64)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(4,), capture=False)
    eager, pooled = twin_states(drafter, pool, 3)
    lengths = [2, W, 3 * W + 1]
    grow(drafter, eager, lengths, [0] * 3)
    grow(drafter, pooled, lengths, [0] * 3)
    want = drafter.draft_batch(eager, [5, 9, 21], lengths, 6)  # [3, 5, V]
    ids = graphs.run(pooled, [5, 9, 21], lengths, 6, greedy=True)
    assert ids.shape == (3, 5) and torch.equal(ids, want.argmax(-1))
    logits = graphs.run(pooled, [5, 9, 21], lengths, 6)
    graphs.run(pooled[:1], [7], lengths[:1], 6, greedy=True)  # the same graph replays
    torch.testing.assert_close(logits, want, **TOL)  # returned logits are the caller's own


def test_a_full_lru_drops_the_oldest_graph_and_its_key_captures_again():
    drafter = make()
    pool = DraftKVPool(drafter, slots=8, context=128)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(1, 2, 4), max_graphs=1, capture=False)
    eager, pooled = twin_states(drafter, pool, 3)
    lengths = [2, W, 3 * W + 1]
    grow(drafter, eager, lengths, [0] * 3)
    grow(drafter, pooled, lengths, [0] * 3)
    for n_req in (3, 1, 3):  # keys (4, 6, 128), (1, 6, 128), (4, 6, 128) again
        anchors = [5, 9, 21][:n_req]
        want = drafter.draft_batch(eager[:n_req], anchors, lengths[:n_req], 6)
        got = graphs.run(pooled[:n_req], anchors, lengths[:n_req], 6)
        torch.testing.assert_close(got, want, **TOL)
    assert graphs.captures == 3 and graphs.pop_evictions() == 2 and graphs.pop_evictions() == 0
    assert set(graphs._graphs) == {(4, 6, 128)}


def test_unpooled_states_and_big_batches_fall_back_to_eager():
    drafter = make()
    pool = DraftKVPool(drafter, slots=2, context=16)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(1, 2), capture=False)
    a, b, c = (pool.new_state() for _ in range(3))
    assert (a.pool_slot, b.pool_slot, c.pool_slot) == (1, 2, None)  # pool full: c unpooled
    assert pool.free_slots == 0
    for s in (a, b, c):
        drafter.append_context(s, feats(5), 0)
    assert graphs.run([a, c], [1, 2], [5, 5], 6) is None  # c is not in the pool
    assert graphs.run([a, b], [1, 2], [5, 5], 6) is not None
    # A full layer outgrowing the pool's 16 rows moves to its own buffer: eager from then on.
    drafter.append_context(a, feats(20)[5:20], 5)
    assert a.layers[2].pool_slot is None and a.pooled_slot() is None
    assert a.layers[0].pool_slot == 1  # sliding layers stay (their ring is W <= 16 rows)
    assert graphs.run([a], [1], [20], 6) is None
    ref = drafter.new_state()
    drafter.append_context(ref, feats(20), 0)
    torch.testing.assert_close(drafter.draft_batch([a], [1], [20], 6, pool=pool),
                               drafter.draft_batch([ref], [1], [20], 6), **TOL)  # fmt: skip
    # Release gives slots back once (idempotent), and they are reused.
    pool.release(a)
    pool.release(a)
    assert pool.free_slots == 1 and pool.new_state().pool_slot == 1


def test_custom_backend_is_never_pooled():
    counted = []

    def fn(*args):
        counted.append(1)
        return TORCH_ATTENTION.fn(*args)

    drafter = make(attention_backend=type(TORCH_ATTENTION)("custom", fn, True))
    pool = DraftKVPool(drafter, slots=2, context=16)
    state = pool.new_state()
    drafter.append_context(state, feats(4), 0)
    assert DraftGraphs(drafter, pool, capture=False).run([state], [1], [4], 6) is None
    drafter.draft_batch([state], [1], [4], 6, pool=pool)
    assert len(counted) == 3  # the custom function ran per layer (per request)


def open_prompts(*proposers) -> None:
    """Open requests "a" and "b" in every proposer, with the same prompts and features."""
    prompts = {"a": list(range(1, 12)), "b": list(range(20, 25))}
    for prop in proposers:
        for rid, ids in prompts.items():
            prop.open(rid, ids)
            prop.add_features(rid, 0, feats(len(ids) - 1, seed=len(ids)))


def test_proposer_with_pool_and_graphs_proposes_what_eager_does():
    drafter = make()
    pool = DraftKVPool(drafter, slots=4, context=64)
    graphed = DFlashProposer(drafter, pool, DraftGraphs(drafter, pool, capture=False))
    plain = DFlashProposer(drafter)
    open_prompts(graphed, plain)
    assert graphed.propose_batch(["a", "b"], 5) == plain.propose_batch(["a", "b"], 5)
    assert graphed.pop_forwards() == {"graph": 1, "eager": 0}
    assert graphed.pop_forwards() == {"graph": 0, "eager": 0}  # counts since the last pop
    assert not graphed.graph_capture_failed
    graphed.graphs.failed = True  # as after a failed capture: eager, and reported
    assert graphed.propose_batch(["a", "b"], 5) == plain.propose_batch(["a", "b"], 5)
    assert graphed.pop_forwards() == {"graph": 0, "eager": 1} and graphed.graph_capture_failed
    assert graphed.pop_keys_read() == plain.pop_keys_read()
    graphed.release("a")
    assert pool.free_slots == 3
    with pytest.raises(ValueError, match="own pool"):
        DFlashProposer(drafter, None, DraftGraphs(drafter, pool, capture=False))


@needs_triton
def test_pooled_triton_attention_matches_torch(monkeypatch):
    monkeypatch.setenv("SPLITFLASH_FORCE_TRITON", "1")
    torch_d, triton_d = make(), make(attention_backend=TRITON_ATTENTION)
    pools = [DraftKVPool(d, slots=3, context=64) for d in (torch_d, triton_d)]
    lengths = [0, W + 1, 4 * W + 5]
    states = []
    for d, pool in zip((torch_d, triton_d), pools, strict=True):
        ss = [pool.new_state() for _ in lengths]
        grow(d, ss, lengths, [0] * 3)
        states.append(ss)
    want = torch_d.draft_batch(states[0], [4, 5, 6], lengths, 6, pool=pools[0])
    graphs = DraftGraphs(triton_d, pools[1], batch_sizes=(4,), capture=False)
    torch.testing.assert_close(graphs.run(states[1], [4, 5, 6], lengths, 6), want,
                               atol=1e-4, rtol=1e-4)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU, TRITON_INTERPRET unset")
def test_captured_draft_graphs_replay_eager_logits():
    drafter = make(cfg_dict(window=64)).cuda()
    with pytest.raises(ValueError, match="embedding and LM head on the drafter's device"):
        DraftGraphs(drafter, DraftKVPool(drafter, slots=1, context=16))  # shared still on CPU
    emb, head = shared(0)
    drafter.attach_shared(torch.nn.Embedding.from_pretrained(emb.weight.cuda()), head.cuda())
    pool = DraftKVPool(drafter, slots=4, context=4096)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(1, 4))
    eager, pooled = [drafter.new_state() for _ in range(3)], [pool.new_state() for _ in range(3)]
    lengths, marks = [5, 100, 3000], [[0] * 3, [0] * 3]
    for step in range(3):
        lengths = [n + 7 * step for n in lengths]
        grow(drafter, eager, lengths, marks[0])
        grow(drafter, pooled, lengths, marks[1])
        want = drafter.draft_batch(eager, [1, 2, 3], lengths, 6)
        got = graphs.run(pooled, [1, 2, 3], lengths, 6)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # fp32 weights
    assert graphs.captures == 1 and graphs.replays == 3 and not graphs.failed
    assert next(iter(graphs._graphs.values())).graph is not None


@pytest.mark.parametrize("capture", [
    False,
    pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not CUDA or INTERPRET, reason="needs a CUDA GPU, TRITON_INTERPRET unset")]),
])  # fmt: skip
def test_graphs_of_one_batch_and_block_share_their_logits_and_replay_in_any_order(capture):
    """Two requests in different context buckets drafted in turn: both graphs of (1, 6)
    write one static logits tensor, and each step in alternating order gives the eager
    step's logits."""
    drafter = make(cfg_dict(window=64))
    if capture:
        drafter = drafter.cuda()
        emb, head = shared(0)
        drafter.attach_shared(torch.nn.Embedding.from_pretrained(emb.weight.cuda()), head.cuda())
    pool = DraftKVPool(drafter, slots=4, context=1024)
    graphs = DraftGraphs(drafter, pool, batch_sizes=(1, 2), capture=capture)
    eager, pooled = [drafter.new_state() for _ in range(2)], [pool.new_state() for _ in range(2)]
    lengths, marks = [20, 300], [[0] * 2, [0] * 2]  # context buckets 256 and 512
    for step in range(3):
        lengths = [n + 5 * step for n in lengths]
        grow(drafter, eager, lengths, marks[0])
        grow(drafter, pooled, lengths, marks[1])
        for i in (0, 1, 0):
            want = drafter.draft_batch([eager[i]], [3 + i], [lengths[i]], 6)
            got = graphs.run([pooled[i]], [3 + i], [lengths[i]], 6)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert sorted(graphs._graphs) == [(1, 6, 256), (1, 6, 512)]
    first, second = graphs._graphs.values()
    assert first.out is second.out and graphs.captures == 2 and graphs.replays == 9


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU, TRITON_INTERPRET unset")
def test_a_steps_host_features_are_staged_on_the_gpu_and_draft_what_device_rows_do():
    """Host rows of a step (<= STAGE_ROWS) move to the GPU on arrival, a prompt's stay on the
    host; either way the proposals equal those of a proposer given the rows on the GPU."""
    drafter = make(cfg_dict(window=64)).cuda()
    emb, head = shared(0)
    drafter.attach_shared(torch.nn.Embedding.from_pretrained(emb.weight.cuda()), head.cuda())
    props = []
    for _ in range(2):
        pool = DraftKVPool(drafter, slots=4, context=1024)
        props.append(DFlashProposer(drafter, pool, DraftGraphs(drafter, pool, batch_sizes=(2,))))
    staged, direct = props
    prompts = {"a": list(range(1, 12)), "b": list(range(1, 1 + STAGE_ROWS + 10))}
    for rid, ids in prompts.items():
        for prop, dev in ((staged, "cpu"), (direct, "cuda")):
            prop.open(rid, ids)
            prop.add_features(rid, 0, feats(len(ids) - 1, seed=len(ids)).to(dev))
    assert staged.requests["a"].pending[0][1].is_cuda  # 10 rows: staged
    assert not staged.requests["b"].pending[0][1].is_cuda  # a prompt's 73 rows stay
    for step in range(3):
        got, want = (p.propose_batch(["a", "b"], 5) for p in (staged, direct))
        assert got == want
        for rid, ids in prompts.items():
            ids.extend([7 + step, 8 + step])
            for prop, dev in ((staged, "cpu"), (direct, "cuda")):
                prop.extend(rid, ids[-2:], len(ids))
                prop.add_features(rid, len(ids) - 3, feats(2, seed=step).to(dev))
            assert staged.requests[rid].pending[-1][1].is_cuda
    assert staged.pop_forwards() == {"graph": 3, "eager": 0}
