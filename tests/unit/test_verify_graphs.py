"""Padded graph steps (models/graphs.py) against plain eager steps of the same engine state.

On CPU the graphs run with capture=False: the same static buffers, padding rows and scratch
pages as on CUDA, only not captured. The `gpu` test captures real CUDA graphs.
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from splitflash.models.graphs import VerifyGraphs
from splitflash.models.kv_cache import PagedKVCache
from splitflash.services.draft.config import DraftSettings
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine, VerifyInput
from splitflash.services.verify.sampling import Sampling
from tests.conftest import tiny_model

PAGE = 4


def _engine(model, graphs: bool, capture: bool = False, sizes=(1, 2, 4, 8),
            pages: int = 96) -> TargetEngine:  # fmt: skip
    cfg = model.cfg
    dev = model.embed_tokens.weight.device
    cache = PagedKVCache(cfg.num_layers, pages, PAGE, cfg.num_kv_heads, cfg.head_dim,
                         dtype=model.embed_tokens.weight.dtype, device=dev,
                         scratch_pages=16 if graphs else 0)  # fmt: skip
    runner = VerifyGraphs(model, cache, sizes, capture=capture) if graphs else None
    return TargetEngine(model, cache, feature_layer_ids=(0, 2), graphs=runner)


def _run(engine: TargetEngine, prompts, block_lens, seed: int) -> list[list]:
    """Prefill every prompt, then verify steps with random drafts; returns per-step records."""
    rng = random.Random(seed)
    vocab = engine.model.cfg.vocab_size
    records = []
    for i, prompt in enumerate(prompts):
        engine.prefill(f"r{i}", prompt, Sampling(), (), 10_000)
    for q in block_lens:
        items = [
            VerifyInput(rid, len(seq.tokens), [rng.randrange(vocab) for _ in range(q - 1)], 10_000)
            for rid, seq in engine.seqs.items()
        ]
        for rep in engine.verify(items):
            assert rep.error is None and not rep.violations
            records.append((rep.request_id, rep.outcome.committed, rep.features))
    return records


def _same(a, b, atol: float) -> None:
    assert len(a) == len(b)
    for (rid_a, tok_a, feat_a), (rid_b, tok_b, feat_b) in zip(a, b, strict=True):
        assert (rid_a, tok_a) == (rid_b, tok_b)
        torch.testing.assert_close(feat_a, feat_b, rtol=0, atol=atol)


def test_padded_steps_equal_eager_steps_on_cpu():
    model = tiny_model()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7]]  # 3 requests -> pad to 4
    blocks = [4, 4, 1, 1, 6, 4]
    eager = _engine(model, graphs=False)
    padded = _engine(model, graphs=True)
    want = _run(eager, prompts, blocks, seed=1)
    got = _run(padded, prompts, blocks, seed=1)
    # Attention is per request; only the GEMMs see more rows (BLAS may block them otherwise).
    _same(want, got, atol=1e-5)
    assert padded.graphs.replays == len(blocks)
    # One static step per (B_pad, Q, KV bucket, layers): Q in {4, 1, 6}, all under 256 keys.
    assert padded.graphs.captures == 3
    n, seconds = padded.graphs.pop_capture_stats()  # what the verify service exports
    assert n == 3 and seconds > 0 and padded.graphs.pop_capture_stats() == (0, 0.0)
    # Padding wrote only scratch pages: the pool's accounting and every request's KV agree.
    assert padded.cache.used_pages == eager.cache.used_pages
    for rid in eager.seqs:
        n = eager.cache.seq(rid).length
        sa, sb = eager.cache.slots(rid, 0, n), padded.cache.slots(rid, 0, n)
        for layer in range(eager.cache.k.shape[0]):
            for kv_a, kv_b in zip(eager.cache.read(layer, sa), padded.cache.read(layer, sb),
                                  strict=True):  # fmt: skip
                torch.testing.assert_close(kv_a, kv_b, rtol=0, atol=1e-5)


def test_keys_choose_padding_or_eager():
    model = tiny_model()
    graphs = _engine(model, graphs=True, sizes=(1, 2, 4)).graphs
    assert graphs.key_for([4, 4, 4], [10, 300, 20]) == (4, 4, 512)
    assert graphs.key_for([1], [7]) == (1, 1, 256)
    assert graphs.key_for([4, 3], [10, 10]) is None  # mixed block lengths: eager
    assert graphs.key_for([2] * 5, [10] * 5) is None  # more requests than the largest graph
    assert graphs.key_for([65], [100]) is None  # longer than a verify block


def test_a_failed_capture_falls_back_to_eager_steps(monkeypatch, caplog):
    model = tiny_model()
    prompts = [[3, 1, 4, 1, 5], [2, 7]]
    want = _run(_engine(model, graphs=False), prompts, [4, 4], seed=3)
    engine = _engine(model, graphs=True)

    def broken(*_):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(engine.graphs, "_capture", broken)
    got = _run(engine, prompts, [4, 4], seed=3)
    _same(want, got, atol=0.0)  # eager steps, the same as the plain engine
    assert engine.graphs.failed and engine.graphs.replays == 0
    assert "CUDA graph capture failed" in caplog.text


def test_the_lru_keeps_max_graphs_and_a_dropped_key_captures_again(caplog):
    """graph_max_held: the least recently used graph goes; a step of its key then captures
    a new one, and every step's output is still the eager step's."""
    model = tiny_model()
    prompts, blocks = [[3, 1, 4, 1, 5]], [4, 1, 2, 4, 2]
    want = _run(_engine(model, graphs=False), prompts, blocks, seed=4)
    engine = _engine(model, graphs=True)
    engine.graphs.max_graphs = 2
    with caplog.at_level(logging.INFO, "splitflash.graphs"):
        got = _run(engine, prompts, blocks, seed=4)
    _same(want, got, atol=1e-5)
    # Q 4, 1, 2 capture (4 dropped), 4 again (1 dropped), then 2 replays.
    assert engine.graphs.captures == 4 and engine.graphs.replays == 5
    assert [key[1] for key in engine.graphs._graphs] == [4, 2]
    assert caplog.text.count("dropped verify graph") == 2
    assert engine.graphs.pop_evictions() == 2 and engine.graphs.pop_evictions() == 0


def test_graphs_need_scratch_pages():
    model = tiny_model()
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 8, PAGE, cfg.num_kv_heads, cfg.head_dim)
    with pytest.raises(ValueError, match="scratch_pages"):
        VerifyGraphs(model, cache, (1, 2), capture=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_captured_graphs_equal_eager_on_gpu():
    model = tiny_model().to("cuda")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7]]
    blocks = [4, 4, 1, 1, 6, 4, 4, 4]
    want = _run(_engine(model, graphs=False), prompts, blocks, seed=2)
    graphed = _engine(model, graphs=True, capture=True)
    got = _run(graphed, prompts, blocks, seed=2)
    # Same kernels; the graph plans its KV splits for the bucket, so sums may reorder.
    _same(want, got, atol=1e-4)
    assert graphed.graphs.replays == len(blocks) and graphed.graphs.captures == 3


@pytest.mark.parametrize("capture", [
    False,
    pytest.param(True, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")]),
])  # fmt: skip
def test_graphs_of_one_row_count_share_their_outputs_and_replay_in_any_order(capture):
    """Two requests in different KV buckets verified in turn: two graphs of 4 rows write
    the same static logits and features (no copy held per graph), yet every step, in
    alternating order, gives the eager step's tokens and features."""
    model = tiny_model().to("cuda" if capture else "cpu")
    rng = random.Random(6)
    prompts = {"short": [rng.randrange(97) for _ in range(40)],  # KV bucket 256
               "long": [rng.randrange(97) for _ in range(270)]}  # bucket 512  # fmt: skip
    records = {}
    for graphs in (False, True):
        engine = _engine(model, graphs=graphs, capture=capture, pages=128)
        for rid, prompt in prompts.items():
            engine.prefill(rid, prompt, Sampling(), (), 10_000)
        drafts = random.Random(7)
        steps = []
        for rid in ["short", "long"] * 3 + ["short"]:
            q = 1 if len(steps) == 6 else 4  # the last step: another row count
            item = VerifyInput(rid, len(engine.seqs[rid].tokens),
                               [drafts.randrange(97) for _ in range(q - 1)], 10_000)  # fmt: skip
            (rep,) = engine.verify([item])
            assert rep.error is None and not rep.violations
            steps.append((rid, rep.outcome.committed, rep.features))
        records[graphs] = steps
        if graphs:
            held = engine.graphs._graphs
            assert sorted(k[:3] for k in held) == [(1, 1, 256), (1, 4, 256), (1, 4, 512)]
            by_rows = {k[1]: entry.out for k, entry in held.items()}
            four = [entry.out for k, entry in held.items() if k[1] == 4]
            assert four[0].logits is four[1].logits and four[0].hidden is four[1].hidden
            assert by_rows[1].logits.shape[0] == 1 and by_rows[4].logits.shape[0] == 4
            assert engine.graphs.replays == 7 and engine.graphs.captures == 3
    _same(records[False], records[True], atol=1e-4 if capture else 1e-5)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, seed=5)])
def test_a_block_past_the_budget_keeps_its_length_and_commits_what_a_cut_block_does(sampling):
    """Drafts past max_commit stay in the block (one block length: one graph, no eager
    batch of mixed lengths) but are not judged: the outcome, the sampler's draws and the KV
    are those of the block cut to the budget, and greedy commits target-only tokens."""
    model = tiny_model()
    prompt = [3, 1, 4, 1, 5]
    plain = _engine(model, graphs=False)  # target-only greedy continuation: 6 tokens
    plain.prefill("t", prompt, Sampling(), (), 10_000)
    for _ in range(5):
        plain.verify([VerifyInput("t", len(plain.seqs["t"].tokens), [], 10_000)])
    drafts = plain.seqs["t"].tokens[len(prompt) + 1 :]  # what the target would say next
    reports = {}
    for name, ids in (("full", drafts), ("cut", drafts[:2])):
        engine = _engine(model, graphs=True)
        engine.prefill("r", prompt, sampling, (), 10_000)
        (rep,) = engine.verify([VerifyInput("r", len(prompt) + 1, ids, 3)])
        reports[name] = (rep.outcome, engine.cache.seq("r").length, engine.graphs._graphs)
    (full, full_kv, full_graphs), (cut, cut_kv, _) = reports["full"], reports["cut"]
    assert full == cut and full_kv == cut_kv and full.commit_len <= 3
    assert [key[1] for key in full_graphs] == [8]  # the whole block (6), padded to 2^k
    if sampling.greedy:
        assert full.committed == plain.seqs["t"].tokens[len(prompt) + 1 : len(prompt) + 4]


def test_steps_of_mixed_draft_lengths_are_padded_onto_one_graph():
    """An n-gram drafter proposes 0..k tokens a request: the blocks are padded to the next
    power of two of the longest with anchor copies that are never judged, so the step runs
    from one graph and commits what an eager step of the unpadded blocks commits."""
    model = tiny_model()
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7]]
    plain = _engine(model, graphs=False)  # each request's target-only next tokens
    for i, prompt in enumerate(prompts):
        plain.prefill(f"r{i}", prompt, Sampling(), (), 10_000)
        for _ in range(5):
            plain.verify([VerifyInput(f"r{i}", len(plain.seqs[f"r{i}"].tokens), [], 10_000)])
    greedy = {f"r{i}": plain.seqs[f"r{i}"].tokens[len(p) + 1 :] for i, p in enumerate(prompts)}
    drafts = {"r0": greedy["r0"][:2], "r1": greedy["r1"][:1] + [0, 0, 0, 0], "r2": []}
    outcomes = {}
    for graphs in (False, True):
        engine = _engine(model, graphs=graphs)
        for i, prompt in enumerate(prompts):
            engine.prefill(f"r{i}", prompt, Sampling(), (), 10_000)
        items = [VerifyInput(r, len(engine.seqs[r].tokens), d, 10_000) for r, d in drafts.items()]
        outcomes[graphs] = [(r.outcome, r.features.shape) for r in engine.verify(items)]
        assert engine.last_forward_mode == ("graph" if graphs else "eager")
        lengths = {r: engine.cache.seq(r).length for r in drafts}
    assert [o for o, _ in outcomes[True]] == [o for o, _ in outcomes[False]]
    assert [s for _, s in outcomes[True]] == [s for _, s in outcomes[False]]
    assert [o.committed for o, _ in outcomes[True]] == [greedy["r0"][:3], greedy["r1"][:2],
                                                        greedy["r2"][:1]]  # fmt: skip
    assert engine.graphs._graphs and [k[1] for k in engine.graphs._graphs] == [8]  # 6 -> 8
    committed = [len(o.committed) for o, _ in outcomes[True]]
    want = [len(p) + n for p, n in zip(prompts, committed, strict=True)]
    assert list(lengths.values()) == want  # KV holds the committed tokens, no padding


def test_drafts_past_the_budget_never_cost_a_request_its_kv_room():
    """A full pool: the drafts the budget allows still fit, those past it do not. The
    request is served as the cut block, not failed."""
    model = tiny_model()
    prompt, drafts = [3, 1, 4, 1, 5], [7] * 15
    outcomes = []
    for room in (False, True):
        engine = _engine(model, graphs=True)
        engine.prefill("r", prompt, Sampling(), (), 10_000)  # 5 tokens: 2 pages of 4
        if not room:  # leave no free page: 5 + anchor + 1 judged draft fit in 2 pages
            engine.cache.add("hog")
            engine.cache.reserve("hog", engine.cache.free_pages * PAGE)
        (rep,) = engine.verify([VerifyInput("r", len(prompt) + 1, drafts, 2)])
        assert rep.error is None and not rep.violations
        outcomes.append(rep.outcome)
    assert outcomes[0] == outcomes[1] and outcomes[0].commit_len <= 2


def test_drafts_past_a_budget_never_take_the_room_of_another_requests_judged_block():
    model = tiny_model()
    engine = _engine(model, graphs=True)
    for rid in ("a", "b"):
        engine.prefill(rid, [3, 1, 4, 1, 5], Sampling(), (), 10_000)  # 2 pages of 4 each
    engine.cache.add("hog")  # leave 4 pages: a's 15 drafts would take them all, b needs 1
    engine.cache.reserve("hog", (engine.cache.free_pages - 4) * PAGE)
    reports = engine.verify([VerifyInput("a", 6, [7] * 15, 2), VerifyInput("b", 6, [7] * 3, 99)])
    assert [r.error for r in reports] == [None, None]
    assert reports[0].outcome.commit_len <= 2


def test_graph_max_held_must_be_positive():
    with pytest.raises(ValueError, match="graph_max_held"):
        VerifySettings(graph_max_held=0)
    with pytest.raises(ValueError, match="graph_max_held"):
        DraftSettings(graph_max_held=0)
