"""Start-up warm-ups (services/verify/warmup.py, services/draft/warmup.py) must leave no
trace: afterwards the engine / proposer holds no request, its KV pool and pool slots are all
free, the metrics' counters are at zero, and requests served next give exactly what they
give without a warm-up. On CPU the graphs run their static steps without capture, so the
warm-up's graph keys are really reused by the requests that follow."""

from __future__ import annotations

import logging

import pytest
import torch

from splitflash.models.dflash.graphs import DraftGraphs
from splitflash.models.dflash.pool import DraftKVPool
from splitflash.services.draft.dflash_drafter import DFlashProposer
from splitflash.services.draft.warmup import warm_up as warm_up_drafter
from splitflash.services.verify.sampling import Sampling
from splitflash.services.verify.warmup import IdleWarmUp
from splitflash.services.verify.warmup import warm_up as warm_up_verify
from tests.conftest import tiny_model
from tests.unit.kernel_env import CUDA, INTERPRET
from tests.unit.test_dflash_support import make, shared
from tests.unit.test_draft_graphs import open_prompts
from tests.unit.test_verify_graphs import _engine, _run


def test_verify_warm_up_leaves_no_trace(caplog):
    model = tiny_model()
    plain, warmed = _engine(model, graphs=True), _engine(model, graphs=True)
    free = warmed.cache.free_pages
    with caplog.at_level(logging.INFO, "splitflash.services.verify.warmup"):
        seconds = warm_up_verify(warmed, contexts=(5, 300), q_lens=(1, 4))
    assert seconds > 0
    assert sum("warm-up 4/4" in r.getMessage() for r in caplog.records) == 1  # every shape ran
    assert warmed.graphs.captures == 4  # (B_pad 1, q 1 / 4, KV bucket 256 / 512)
    assert warmed.graphs.pop_capture_stats() == (0, 0.0)  # popped: not counted as serving
    assert warmed.cache.free_pages == free and not warmed.seqs
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    blocks = [4, 4, 1, 1, 4]
    want, got = _run(plain, prompts, blocks, seed=2), _run(warmed, prompts, blocks, seed=2)
    assert [r[:2] for r in got] == [r[:2] for r in want]
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b[2], a[2], rtol=0, atol=0)


def test_the_prefill_warm_up_runs_a_prompt_in_chunks_and_leaves_no_trace(monkeypatch, caplog):
    """A throwaway prompt of one chunk and PREFILL_TAIL more tokens through the prefill path
    (here: chunks of 64, so the whole-prompt and after-cached chunk paths both run), then the
    cuDNN prebuild, which asks for every aligned chunk start the pool holds (none built off
    CUDA); past PREBUILD_MAX_S the rest is left for the first prompts, with a warning."""
    import splitflash.services.verify.warmup as warmup

    model = tiny_model()
    plain, engine = _engine(model, graphs=False), _engine(model, graphs=False)
    engine.prefill_chunk = plain.prefill_chunk = 64
    free = engine.cache.free_pages
    chunks, asked = [], []
    real = engine.start_prefill

    def spy(rid, prompt, *rest):
        run = real(rid, prompt, *rest)
        advance = run.advance
        run.advance = lambda *a: chunks.append(len(prompt)) or advance(*a)
        return run

    monkeypatch.setattr(engine, "start_prefill", spy)
    monkeypatch.setattr(warmup, "aligned_chunk_starts", lambda c, room: asked.append(
        (c, room)) or [4096, 8192])  # fmt: skip
    monkeypatch.setattr(warmup, "prebuild", lambda *a: asked.append(a[-2]) or 0)
    assert warmup.warm_prefill(engine) == 0
    assert chunks == [364] * 6  # 64 + 300 tokens in chunks of 64
    assert asked == [(64, free * engine.cache.page_size), [4096], [8192]]
    assert engine.cache.free_pages == free and not engine.seqs
    monkeypatch.setattr(warmup, "PREBUILD_MAX_S", -1.0)
    with caplog.at_level(logging.WARNING, "splitflash.services.verify.warmup"):
        assert warmup.warm_prefill(engine) == 0
    assert "0 of 2 chunk shapes built" in caplog.text
    assert asked[-1] == asked[0] and engine.cache.free_pages == free and not engine.seqs
    prompts, blocks = [[3, 1, 4, 1, 5], list(range(2, 90))], [4, 1, 4]
    want, got = _run(plain, prompts, blocks, seed=4), _run(engine, prompts, blocks, seed=4)
    assert [r[:2] for r in got] == [r[:2] for r in want]


def test_a_shape_that_fails_to_build_ends_the_prebuild_with_a_warning(monkeypatch, caplog):
    """Out of memory at a long shape (beside the KV pool) stops the prebuild there: the
    shapes before it stay built, the server starts, later prompts build the rest."""
    import splitflash.services.verify.warmup as warmup

    engine = _engine(tiny_model(), graphs=False)
    free = engine.cache.free_pages

    def prebuild(*args):
        if args[-2] == [8192]:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return 1

    monkeypatch.setattr(warmup, "aligned_chunk_starts", lambda c, room: [4096, 8192, 12288])
    monkeypatch.setattr(warmup, "prebuild", prebuild)
    with caplog.at_level(logging.WARNING, "splitflash.services.verify.warmup"):
        assert warmup.warm_prefill(engine) == 1
    assert "the chunk shape after 8192 keys failed (CUDA out of memory" in caplog.text
    assert engine.cache.free_pages == free and not engine.seqs


def test_verify_warm_up_skips_what_the_pool_cannot_hold():
    engine = _engine(tiny_model(), graphs=False)
    room = engine.cache.free_pages * engine.cache.page_size
    warm_up_verify(engine, contexts=(5, room), q_lens=(1,))  # room + 1 does not fit
    assert engine.cache.free_pages * engine.cache.page_size == room and not engine.seqs


def test_idle_warm_up_captures_the_new_layers_a_shape_a_call_around_open_requests():
    """What the server runs between messages after a Hello switched the feature layers: one
    shape per call, graphs keyed by the new layers, nothing counted as serving, an open
    request's pages untouched, and shapes the pool cannot hold now left out."""
    model = tiny_model()
    engine, plain = _engine(model, graphs=True), _engine(model, graphs=True)
    prompts, blocks = [[3, 1, 4, 1, 5]], [4, 1]
    want = _run(plain, prompts, blocks, seed=3)
    engine.prefill("open", [2, 7, 1, 8], Sampling(), frozenset(), 16)
    free = engine.cache.free_pages
    room = free * engine.cache.page_size  # what the throwaway request may take now
    assert 300 < room <= 512
    engine.feature_layer_ids = (1,)
    warm = IdleWarmUp(engine, contexts=(5, 300, room - 1), q_lens=(1, 4))
    for n in range(1, 5):  # one shape a call; the first four are four keys
        warm.run_one()
        assert engine.graphs.captures == n and engine.cache.free_pages == free
    warm.run_one()  # (room - 1, 1) replays (300, 1)'s key
    assert not warm.done
    warm.run_one()  # (room - 1, 4) does not fit: dropped
    assert warm.done and engine.graphs.captures == 4 and engine.graphs.replays == 5
    assert engine.graphs.pop_capture_stats() == (0, 0.0)  # not counted as serving
    assert {key[1:] for key in engine.graphs._graphs} == {
        (1, 256, (1,)), (4, 256, (1,)), (1, 512, (1,)), (4, 512, (1,)),
    }  # fmt: skip
    assert list(engine.seqs) == ["open"] and engine.cache.seq("open").length == 4
    switched = IdleWarmUp(engine, contexts=(5,), q_lens=(1,))
    engine.feature_layer_ids = (0, 2)  # switched again before it ran: nothing to warm
    switched.run_one()
    assert switched.done and engine.graphs.captures == 4
    engine.release("open")
    got = _run(engine, prompts, blocks, seed=3)
    assert [r[:2] for r in got] == [r[:2] for r in want]


def test_draft_warm_up_leaves_no_trace():
    drafter = make()
    pool = DraftKVPool(drafter, slots=3, context=64)
    warmed = DFlashProposer(drafter, pool, DraftGraphs(drafter, pool, capture=False))
    free = pool.free_slots
    warm_up_drafter(warmed, contexts=(5, 20, 1000))  # 1000 is past the pool: left out
    assert not warmed.requests and pool.free_slots == free
    # Both contexts in one bucket: one key, run by all four drafts (prompt rows written
    # eagerly, then a step's rows inside the graph).
    assert warmed.graphs.captures == 1 and warmed.graphs.replays == 4
    assert warmed.pop_capture_stats() == (0, 0.0)
    assert warmed.pop_forwards() == {"graph": 0, "eager": 0}
    assert warmed.pop_keys_read() == {}
    plain = DFlashProposer(drafter)
    open_prompts(warmed, plain)
    assert warmed.propose_batch(["a", "b"], 5) == plain.propose_batch(["a", "b"], 5)
    assert warmed.pop_keys_read() == plain.pop_keys_read()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRET, reason="needs a CUDA GPU, TRITON_INTERPRET unset")
def test_warm_ups_on_cuda_capture_and_leave_no_trace():
    """Real captures: the graphs the warm-ups leave are the ones later requests replay."""
    model = tiny_model().to("cuda")
    plain, warmed = (_engine(model, graphs=True, capture=True) for _ in range(2))
    warm_up_verify(warmed, contexts=(5, 300), q_lens=(1, 4))
    assert warmed.graphs.captures == 4 and not warmed.seqs
    prompts, blocks = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]], [4, 4, 1, 1, 4]
    want, got = _run(plain, prompts, blocks, seed=2), _run(warmed, prompts, blocks, seed=2)
    assert [r[:2] for r in got] == [r[:2] for r in want]
    drafter = make().cuda()
    emb, head = shared(0)
    drafter.attach_shared(torch.nn.Embedding.from_pretrained(emb.weight.cuda()), head.cuda())
    pool = DraftKVPool(drafter, slots=3, context=64)
    graphs = DraftGraphs(drafter, pool)
    warm_up_drafter(DFlashProposer(drafter, pool, graphs), contexts=(5, 20))
    assert graphs.captures == 1 and graphs.replays == 4 and pool.free_slots == 3
