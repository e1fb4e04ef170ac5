"""bench/long_context.py's divergence diagnosis: the logit gap it reports is the target's own
(HF transformers on the same weights is the oracle), and it leaves the KV cache as it found
it."""

from __future__ import annotations

import torch

from bench.long_context import diagnose
from tests.conftest import tiny_engine, tiny_model
from tests.unit.test_target_vs_hf import hf_twin


def test_diagnose_reports_the_targets_logit_gap_at_the_first_difference():
    engine = tiny_engine(tiny_model(seed=3))
    prompt = [5, 9, 2, 7, 11]
    ref = [3, 8, 1, 4]
    out = [3, 8, 6, 4]  # leaves ref at index 2
    free_before = engine.cache.free_pages
    got = diagnose(engine, prompt, ref, out)

    # The oracle: HF transformers holding the same weights, over prompt + ref[:2].
    with torch.inference_mode():
        ids = torch.tensor([prompt + ref[:2]])
        logits = hf_twin(engine.model)(ids).logits[0, -1].float()
    assert got["position"] == 2
    assert (got["target_token"], got["spec_token"]) == (1, 6)
    assert abs(got["logit_gap"] - float(logits[1] - logits[6])) < 1e-3
    assert abs(got["top2"][0] - float(logits.max())) < 1e-3
    assert engine.cache.free_pages == free_before  # the probe's pages are given back


def test_diagnose_names_a_length_difference():
    engine = tiny_engine(tiny_model(seed=3))
    got = diagnose(engine, [5, 9], [3, 8, 1], [3, 8])
    assert got["position"] == 2 and "length" in got["note"]
