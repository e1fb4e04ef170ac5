"""Token ids outside the target's vocabulary: a prompt holding one is refused with an error
naming it (the pool keeps no page of it); a draft holding one is judged up to it, which
commits what target-only decoding commits. On CUDA the embedding lookup of such an id
would be a device-side assert that ends every request of the process."""

from __future__ import annotations

import logging

import pytest

from splitflash.services.verify.engine import VerifyInput
from splitflash.services.verify.sampling import Sampling
from tests.conftest import tiny_engine, tiny_model

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.mark.parametrize("bad", [-1, "vocab", 10**9])
def test_a_prompt_with_an_id_outside_the_vocabulary_is_refused_and_leaves_nothing(bad):
    engine = tiny_engine(tiny_model())
    vocab = engine.model.cfg.vocab_size
    bad = vocab if bad == "vocab" else bad
    with pytest.raises(ValueError, match=f"prompt token 2 is id {bad}, outside the target's "
                                         f"vocabulary of {vocab} ids"):  # fmt: skip
        engine.start_prefill("r", PROMPT[:2] + [bad] + PROMPT[2:], Sampling(), (), 10)
    assert engine.cache.used_pages == 0 and "r" not in engine.seqs
    report = engine.prefill("r", PROMPT + [vocab - 1], Sampling(), (), 10)  # the last id: fine
    assert report.error is None and len(report.outcome.committed) == 1


def _target_only(engine, steps: int) -> list[int]:
    """The prompt's first token, then `steps` plain greedy steps."""
    out = engine.prefill("r", PROMPT, Sampling(), (), 100).outcome.committed
    for _ in range(steps):
        (report,) = engine.verify([VerifyInput("r", len(PROMPT) + len(out), [], 100)])
        out += report.outcome.committed
    return out


@pytest.mark.parametrize("bad", [-5, "vocab"])
def test_drafts_are_judged_up_to_an_id_outside_the_vocabulary(bad, caplog):
    model = tiny_model()
    want = _target_only(tiny_engine(model), 4)  # [t1, t2, t3, t4, t5]
    engine = tiny_engine(model)
    bad = model.cfg.vocab_size if bad == "vocab" else bad
    first = engine.prefill("r", PROMPT, Sampling(), (), 100).outcome.committed
    assert first == want[:1]
    drafts = [want[1], want[2], bad, want[4]]  # right, right, outside, right
    with caplog.at_level(logging.WARNING):
        (report,) = engine.verify([VerifyInput("r", len(PROMPT) + 1, drafts, 100)])
    assert report.error is None
    assert report.outcome.committed == want[1:4]  # t2, t3 accepted; t4 the target's own
    assert f"draft token 2 is id {bad}, outside the target's vocabulary" in caplog.text
    # the KV holds exactly the committed tokens: the next plain step goes on as target-only
    (nxt,) = engine.verify([VerifyInput("r", len(PROMPT) + 4, [], 100)])
    assert nxt.outcome.committed == want[4:5]


def test_a_drafter_outside_the_vocabulary_warns_once_a_minute_with_a_count(caplog):
    """Such a drafter does it every step: one warning a minute, counting the steps cut."""
    model = tiny_model()
    engine = tiny_engine(model)
    out = engine.prefill("r", PROMPT, Sampling(), (), 100).outcome.committed
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            step = VerifyInput("r", len(PROMPT) + len(out), [model.cfg.vocab_size], 100)
            out += engine.verify([step])[0].outcome.committed
        engine._vocab_logged_at -= 61.0  # a minute later
        step = VerifyInput("r", len(PROMPT) + len(out), [model.cfg.vocab_size], 100)
        engine.verify([step])
    warned = [m for r in caplog.records if "outside the target's" in (m := r.getMessage())]
    assert len(warned) == 2 and "(1 steps cut so far" in warned[0]
    assert "(4 steps cut so far" in warned[1]
