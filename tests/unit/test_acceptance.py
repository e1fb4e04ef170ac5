"""Chain acceptance: greedy exactness, rejection sampling's distribution, invariants."""

import numpy as np
import pytest
import torch

from splitflash.local import generate_local
from splitflash.services.common.spec_stats import SpecStats
from splitflash.services.draft.ngram import NgramDrafter
from splitflash.services.verify.acceptance import (
    StepOutcome,
    accept_chain_greedy,
    accept_chain_sampled,
    check_invariants,
    truncate_outcome,
)
from splitflash.services.verify.sampling import Sampling, target_probs
from tests.conftest import tiny_engine, tiny_model


def one_hot_logits(tokens, vocab=10):
    logits = torch.full((len(tokens), vocab), -5.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


@pytest.mark.parametrize(
    "draft,target,accepted",
    [([1, 2, 3], [1, 2, 3, 4], 3), ([1, 9, 3], [1, 2, 3, 4], 1), ([], [7], 0), ([5], [1, 2], 0)],
)
def test_greedy_longest_prefix_plus_bonus(draft, target, accepted):
    out = accept_chain_greedy(draft, one_hot_logits(target))
    assert out.accepted_drafts == accepted == out.accepted_depth
    assert out.committed == draft[:accepted] + [target[accepted]]
    assert check_invariants(out, len(draft), finished=False) == []


def test_invariants_catch_broken_steps():
    bad = StepOutcome(committed=[1], accepted_drafts=3, accepted_depth=2, draft_tokens=2, path=[])
    assert set(check_invariants(bad, 2, False)) == {
        "accepted_range",
        "depth_equals_accepted",
        "commit_len",
        "accepted_le_drafted",
    }
    ok = StepOutcome([1, 2, 3], 2, 2, 4, [1, 2])
    cut = truncate_outcome(ok, max_commit=5, stop_ids={2})
    assert cut.committed == [1, 2]
    assert check_invariants(cut, 4, finished=True) == []
    assert check_invariants(cut, 4, finished=False) == ["commit_len"]


def test_spec_stats_are_pooled_not_averaged():
    stats = SpecStats()
    stats.record(draft_tokens=7, max_depth=7, accepted=7, commit_len=8)
    for _ in range(3):
        stats.record(draft_tokens=7, max_depth=7, accepted=0, commit_len=1)
    d = stats.to_dict()
    assert d["mean_commit_len"] == pytest.approx(11 / 4)
    assert d["acceptance_rate"] == pytest.approx(7 / 28)
    assert d["accepted_per_position"] == [0.25] * 7


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    from scipy.stats import chisquare

    keep = probs * counts.sum() >= 5  # pool rare cells so the test is valid
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(probs[keep], probs[~keep].sum()) * counts.sum()
    obs, exp = obs[exp > 0], exp[exp > 0]
    exp = exp * obs.sum() / exp.sum()  # float32 probabilities: renormalise exactly
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.parametrize("use_q", [False, True])
def test_rejection_sampling_preserves_target_distribution(use_q):
    """First committed token of a step, drafted from a tiny random model's own distribution
    (or deterministically), must be distributed as the target's p at the anchor."""
    model = tiny_model(seed=5)
    engine = tiny_engine(model)
    sampling = Sampling(temperature=1.3, top_k=20, top_p=0.95)
    engine.cache.add("x")
    prompt = [3, 14, 15, 92]
    engine.cache.reserve("x", len(prompt))
    with torch.no_grad():
        logits = model(engine._batch([("x", prompt, 0)]), engine.cache).logits
    p = target_probs(logits[-1:], sampling)[0]  # [V]
    q = torch.softmax(torch.randn(1, 97, generator=torch.Generator().manual_seed(9)), -1)
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = np.zeros(97)
    probs2 = torch.stack([p, p])
    for _ in range(n):
        if use_q:
            x = int(torch.multinomial(q[0], 1, generator=gen))
            out = accept_chain_sampled([x], probs2, gen, draft_probs=q)
        else:
            out = accept_chain_sampled([int(p.argmax())], probs2, gen)
        counts[out.committed[0]] += 1
    assert chi_square_p(counts, p.double().numpy()) > 1e-3
    # and the test has power: counts drawn from q instead are rejected
    wrong = np.bincount(torch.multinomial(q[0], n, True, generator=gen).numpy(), minlength=97)
    assert chi_square_p(wrong.astype(float), p.double().numpy()) < 1e-6


def test_speculative_greedy_equals_target_only_on_tiny_model():
    model = tiny_model(seed=7)
    engine = tiny_engine(model, pages=128)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 1, 2]
    plain = generate_local(engine, None, prompt, 40)
    spec = generate_local(engine, NgramDrafter(), prompt, 40, block_size=6)
    assert spec.token_ids == plain.token_ids
    assert spec.violations == []
    assert spec.stats.steps < plain.stats.steps + 1
    assert sum(len(s.pages) for s in engine.cache.seqs.values()) == 0
    assert engine.cache.free_pages == engine.cache.num_pages
