"""Several prompts' chunks in ONE forward (prompt_run.advance_together).

Oracle: each prompt prefilled alone by the same model (TargetEngine.prefill), then plain
decoding: the packed prefill must commit the same first token, leave the same feature rows
and the same KV (the decoding after it gives the same tokens)."""

from __future__ import annotations

import pytest
import torch

from splitflash.services.verify.engine import VerifyInput
from splitflash.services.verify.prompt_run import advance_together
from splitflash.services.verify.sampling import Sampling
from tests.conftest import tiny_engine, tiny_model

PROMPTS = {
    "a": [3, 1, 4, 1, 5, 9, 2, 6, 5, 3],
    "b": [(i * 37 + 11) % 97 for i in range(150)],  # past 64: the SDPA path, 3 chunks of 65
    "c": [(i * 13 + 5) % 89 for i in range(30)],
    "d": [7],
}
STEPS = 4


def _engine(model):
    engine = tiny_engine(model, pages=160)
    engine.feature_layer_ids = (0, 2)
    engine.prefill_chunk = 65
    return engine


def _decode(engine, rid: str, first: list[int]) -> list[int]:
    """STEPS plain steps (no draft) after the prefill's first token."""
    out = list(first)
    for _ in range(STEPS):
        base = len(PROMPTS[rid]) + len(out)
        (report,) = engine.verify([VerifyInput(rid, base, [], 100)])
        out += report.outcome.committed
    return out


def test_packed_prompts_leave_what_each_prompt_alone_leaves():
    model = tiny_model()
    alone, packed = _engine(model), _engine(model)
    want = {rid: alone.prefill(rid, p, Sampling(), (), 100) for rid, p in PROMPTS.items()}
    runs = {rid: packed.start_prefill(rid, p, Sampling(), (), 100) for rid, p in PROMPTS.items()}
    got, forwards = {}, 0
    while len(got) < len(runs):
        open_runs = [(rid, run) for rid, run in runs.items() if rid not in got]
        reports = advance_together([(run, None) for _, run in open_runs])
        forwards += 1
        got.update({rid: r for (rid, _), r in zip(open_runs, reports, strict=True) if r})
    assert forwards == 3  # "b" needs 3 chunks of 65; the others finish in the first forward
    for rid in PROMPTS:
        assert got[rid].outcome.committed == want[rid].outcome.committed, rid
        torch.testing.assert_close(got[rid].features, want[rid].features, atol=2e-5, rtol=1e-5)
        assert not got[rid].features.requires_grad  # no autograd graph held: inference mode
        first = got[rid].outcome.committed
        assert _decode(packed, rid, first) == _decode(alone, rid, want[rid].outcome.committed)


def test_a_cap_per_run_and_its_chunks_in_order():
    model = tiny_model()
    alone, packed = _engine(model), _engine(model)
    want = alone.prefill("b", PROMPTS["b"], Sampling(), (), 100)
    b = packed.start_prefill("b", PROMPTS["b"], Sampling(), (), 100)
    a = packed.start_prefill("a", PROMPTS["a"], Sampling(), (), 100)
    assert advance_together([(b, 40), (a, 4)]) == [None, None]
    assert (b.cached, a.cached) == (40, 4)
    while (report := advance_together([(b, 50)])[0]) is None:
        pass
    assert b.cached == 150 and report.outcome.committed == want.outcome.committed
    torch.testing.assert_close(report.features, want.features, atol=2e-5, rtol=1e-5)


def test_a_failed_forward_frees_every_run_and_raises():
    packed = _engine(tiny_model())
    runs = [packed.start_prefill(rid, PROMPTS[rid], Sampling(), (), 100) for rid in ("a", "c")]
    assert packed.cache.used_pages > 0

    def fail(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("no room")

    packed.model.forward = fail
    with pytest.raises(torch.cuda.OutOfMemoryError):
        advance_together([(run, None) for run in runs])
    assert packed.cache.used_pages == 0 and all(run.ended for run in runs)


def test_one_prompt_twice_or_an_ended_run_is_refused():
    packed = _engine(tiny_model())
    run = packed.start_prefill("a", PROMPTS["a"], Sampling(), (), 100)
    with pytest.raises(ValueError, match="one prompt twice"):
        advance_together([(run, None), (run, None)])
    assert advance_together([(run, None)])[0] is not None
    with pytest.raises(RuntimeError, match="already ended"):
        advance_together([(run, None)])
