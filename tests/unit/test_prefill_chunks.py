"""Chunked prefill (TargetEngine.prefill_chunk): a prompt run in chunks, each attending to
the cached chunks before it, must leave what one forward over the whole prompt leaves: the
first token, the drafter's feature rows, the prompt's K/V, and every decode step after it.
A prefill that fails part way must leave no pages behind."""

from __future__ import annotations

import pytest
import torch

from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine, VerifyInput
from splitflash.services.verify.sampling import Sampling
from tests.conftest import tiny_engine, tiny_model

FEATURE_LAYERS = (0, 2)
PROMPT = [(i * 37 + 11) % 97 for i in range(150)]  # past 64: the SDPA prefill path


def _engine(model, chunk: int) -> TargetEngine:
    engine = tiny_engine(model, pages=96, page_size=4)
    engine.feature_layer_ids = FEATURE_LAYERS
    engine.prefill_chunk = chunk
    return engine


def _prompt_kv(engine: TargetEngine, rid: str, n: int) -> torch.Tensor:
    """[L, 2, n, H_KV, D]: the request's cached K and V of positions 0..n-1."""
    slots = engine.cache.slots(rid, 0, n)
    return torch.stack([torch.stack(engine.cache.read(i, slots))
                        for i in range(engine.cache.k.shape[0])])  # fmt: skip


def _decode(engine: TargetEngine, rid: str, steps: int) -> list[int]:
    for _ in range(steps):
        base = len(engine.seqs[rid].tokens)
        (report,) = engine.verify([VerifyInput(rid, base, [], max_commit=100)])
        assert report.error is None
    return engine.seqs[rid].tokens[len(PROMPT) :]


@pytest.mark.parametrize("chunk", [1, 7, 64, 65, 100, 149])
def test_chunked_prefill_leaves_what_one_forward_leaves(chunk):
    model = tiny_model()
    whole, chunked = _engine(model, 10_000), _engine(model, chunk)
    got = chunked.prefill("r", PROMPT, Sampling(), (), 100)
    want = whole.prefill("r", PROMPT, Sampling(), (), 100)
    assert got.outcome.committed == want.outcome.committed
    assert got.features.shape == want.features.shape == (len(PROMPT), 2 * 64)
    torch.testing.assert_close(got.features, want.features, atol=2e-5, rtol=1e-5)
    kv_got, kv_want = (_prompt_kv(e, "r", len(PROMPT)) for e in (chunked, whole))
    torch.testing.assert_close(kv_got, kv_want, atol=2e-5, rtol=1e-5)
    assert chunked.cache.seq("r").length == len(PROMPT)
    assert _decode(chunked, "r", 6) == _decode(whole, "r", 6)


def test_a_prefill_failing_part_way_frees_its_pages_and_can_be_retried(monkeypatch):
    engine = _engine(tiny_model(), 64)
    free = engine.cache.free_pages
    forward, calls = engine.model.forward, []

    def second_chunk_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("out of memory in chunk 2")
        return forward(*args, **kwargs)

    monkeypatch.setattr(engine.model, "forward", second_chunk_fails)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="chunk 2"):
        engine.prefill("r", PROMPT, Sampling(), (), 100)
    assert engine.cache.free_pages == free and "r" not in engine.seqs
    monkeypatch.setattr(engine.model, "forward", forward)
    report = engine.prefill("r", PROMPT, Sampling(), (), 100)
    assert report.committed_len == len(PROMPT) + 1


def test_a_chunk_below_one_token_is_refused():
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1, got 0"):
        VerifySettings(prefill_chunk=0)
    engine = _engine(tiny_model(), 1)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1, got 0"):
        TargetEngine(engine.model, engine.cache, prefill_chunk=0)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="prefill_chunk_ms must be >= 0"):
            VerifySettings(prefill_chunk_ms=bad)


def test_a_prompt_run_takes_a_smaller_chunk_when_asked_never_a_larger_one():
    engine = _engine(tiny_model(), 8)
    run = engine.start_prefill("r", PROMPT, Sampling(), (), 100)
    run.advance(3)
    assert run.cached == 3
    run.advance(100)  # capped at prefill_chunk
    assert run.cached == 3 + 8


def test_a_prompt_run_forwards_one_chunk_per_advance_and_ends_as_prefill_does():
    model = tiny_model()
    engine, whole = _engine(model, 64), _engine(model, 10_000)
    forward, calls = engine.model.forward, []
    engine.model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    run = engine.start_prefill("r", PROMPT, Sampling(), (), 100)
    assert run.chunks_left == 3 and not calls  # reserved, nothing run yet
    assert engine.cache.seq("r").length == 0 and "r" not in engine.seqs
    assert run.advance() is None and len(calls) == 1 and run.cached == 64
    assert run.advance() is None and len(calls) == 2 and run.cached == 128
    report = run.advance()
    assert len(calls) == 3 and run.chunks_left == 0
    want = whole.prefill("r", PROMPT, Sampling(), (), 100)
    assert report.outcome.committed == want.outcome.committed
    torch.testing.assert_close(report.features, want.features, atol=2e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="already ended"):
        run.advance()
    assert _decode(engine, "r", 4) == _decode(whole, "r", 4)


def test_an_aborted_prompt_run_frees_its_pages_and_its_id():
    engine = _engine(tiny_model(), 64)
    free = engine.cache.free_pages
    run = engine.start_prefill("r", PROMPT, Sampling(), (), 100)
    with pytest.raises(ValueError, match="already has KV"):  # one run per id at a time
        engine.start_prefill("r", PROMPT, Sampling(), (), 100)
    assert run.advance() is None
    run.abort()
    assert engine.cache.free_pages == free and "r" not in engine.cache.seqs
    with pytest.raises(RuntimeError, match="already ended"):
        run.advance()
    report = engine.prefill("r", PROMPT, Sampling(), (), 100)
    assert report.committed_len == len(PROMPT) + 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_chunk_has_run_on_the_gpu_when_advance_returns():
    """The verify loop serves the next message after advance(): a chunk still queued on the
    stream would make that step wait behind it (and behind any chunk queued after it)."""
    from splitflash.models.kv_cache import PagedKVCache

    model = tiny_model().to("cuda")
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 96, 4, cfg.num_kv_heads, cfg.head_dim, device="cuda")
    engine = TargetEngine(model, cache, FEATURE_LAYERS, prefill_chunk=64)
    run = engine.start_prefill("r", PROMPT, Sampling(), (), 100)
    while (report := run.advance()) is None:
        assert torch.cuda.current_stream().query(), "the chunk is still queued"
    want = _engine(tiny_model(), 10_000).prefill("r", PROMPT, Sampling(), (), 100)
    assert report.outcome.committed == want.outcome.committed
