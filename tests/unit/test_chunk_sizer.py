"""ChunkSizer: prompt chunks sized to a time budget from the costs of the chunks run so far.

Oracle: a synthetic cost seconds(n, c) = a n + b n (c + n / 2) with known a, b; the sizer's
chunk at context c must cost the budget under it (or be clamped to its limits)."""

from __future__ import annotations

import random

import pytest

from splitflash.services.verify.chunk_sizer import MIN_CHUNK, ChunkSizer

A, B = 2e-6, 1.5e-10  # s per token, s per token x key: ~8192 tokens at 32k take 0.06 s


def cost(n: int, c: int, a: float = A, b: float = B) -> float:
    return a * n + b * n * (c + n / 2)


def run_prompt(sizer: ChunkSizer, length: int, noise: float = 0.0, seed: int = 0) -> list[int]:
    """Chunks of one prompt with decoding requests waiting; returns their sizes."""
    rng, cached, sizes = random.Random(seed), 0, []
    while cached < length:
        n = min(sizer.tokens(cached, others_waiting=True), length - cached)
        sizer.observe(n, cached, cost(n, cached) * (1 + noise * rng.uniform(-1, 1)))
        sizes.append(n)
        cached += n
    return sizes


def test_chunks_cost_the_budget_at_every_context_once_two_ratios_are_seen():
    sizer = ChunkSizer(0.05, 8192)
    run_prompt(sizer, 3 * 8192)  # the first chunk full size, then fitted
    a, b = sizer.coefficients()
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)
    for c in (0, 32_768, 185_000, 1_000_000):
        n = sizer.tokens(c, others_waiting=True)
        if MIN_CHUNK < n < 8192:
            assert cost(n, c) == pytest.approx(0.05, rel=0.01), (c, n)  # n is floored
        else:
            assert (n == 8192 and cost(n, c) < 0.05) or (n == MIN_CHUNK and cost(n, c) > 0.05)
    sizes = [sizer.tokens(c, True) for c in range(0, 400_000, 20_000)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 8192 and sizes[-1] < 1024


def test_a_long_prompt_shrinks_its_chunks_and_keeps_each_near_the_budget():
    sizer = ChunkSizer(0.05, 8192)
    sizes = run_prompt(sizer, 185_000, noise=0.05)
    cached = [sum(sizes[:i]) for i in range(len(sizes))]
    costs = [cost(n, c) for n, c in zip(sizes, cached, strict=True)]
    assert max(costs[2:]) <= 0.05 * 1.12  # 5% timing noise, the fit from the latest chunks
    # and not needlessly small once three noisy points pin both terms (the last: a tail)
    assert min(costs[3:-1]) >= 0.05 * 0.85
    assert sizes[-2] < max(sizes) / 4  # ~1700 tokens at 180k against 8192 early


def test_one_context_to_size_ratio_fits_attention_alone_so_chunks_still_shrink():
    sizer = ChunkSizer(0.05, 8192)
    sizer.observe(4096, 0, cost(4096, 0))  # one chunk: a and b cannot be told apart
    a, b = sizer.coefficients()
    assert a == 0.0 and b > 0
    n_short, n_long = sizer.tokens(0, True), sizer.tokens(100_000, True)
    assert n_long < n_short
    assert b * n_long * (100_000 + n_long / 2) == pytest.approx(0.05, rel=0.01)  # n floored


def test_full_chunks_when_no_one_waits_or_nothing_is_known():
    sizer = ChunkSizer(0.01, 4096)
    assert sizer.tokens(100_000, others_waiting=True) == 4096  # no chunk seen yet
    run_prompt(sizer, 20_000)
    assert sizer.tokens(100_000, others_waiting=False) == 4096
    assert sizer.tokens(100_000, others_waiting=True) < 4096


def test_limits_and_bad_observations():
    sizer = ChunkSizer(1e-6, 8192, min_tokens=64)
    run_prompt(sizer, 2000)
    assert sizer.tokens(50_000, True) == 64  # the budget cannot be met: the floor
    assert ChunkSizer(1.0, 128).min_tokens == 128  # the floor never above the ceiling
    seen = len(sizer._seen)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        sizer.observe(100, 0, bad)
    sizer.observe(0, 0, 1.0)
    assert len(sizer._seen) == seen
    with pytest.raises(ValueError, match="budget_s > 0"):
        ChunkSizer(0.0, 8192)


def test_costs_that_fall_with_context_give_no_negative_term():
    sizer = ChunkSizer(0.05, 8192)
    for c, s in ((0, 0.040), (8192, 0.030), (16_384, 0.020)):  # e.g. a cold start then warm
        sizer.observe(8192, c, s)
    a, b = sizer.coefficients()
    assert a >= 0 and b >= 0 and (a > 0 or b > 0)
    assert MIN_CHUNK <= sizer.tokens(50_000, True) <= 8192


def test_one_very_slow_chunk_does_not_shrink_the_ones_after_it():
    """A first chunk that also compiled kernels (100x its cost) is left out of the fit once
    two more are seen; kept, every chunk would take the floor until it left the history."""
    clean, spiked = ChunkSizer(0.05, 8192), ChunkSizer(0.05, 8192)
    n_clean = len(run_prompt(clean, 3 * 8192))
    spiked.observe(8192, 0, 100 * cost(8192, 0))
    sizes = run_prompt(spiked, 3 * 8192)
    assert len(sizes) <= n_clean + 2 and MIN_CHUNK not in sizes[2:], sizes
    for c in (32_768, 185_000):
        assert spiked.tokens(c, True) == pytest.approx(clean.tokens(c, True), rel=0.01)


def test_packed_forwards_fit_as_the_sum_of_their_chunks():
    """A forward of several prompts' chunks costs the sum of each chunk's terms."""
    sizer = ChunkSizer(0.05, 8192)
    for packs in ([(4096, 0), (100, 30_000)], [(8192, 8192)], [(50, 0), (2000, 100_000)]):
        sizer.observe_pack(packs, sum(cost(n, c) for n, c in packs))
    a, b = sizer.coefficients()
    assert a == pytest.approx(A, rel=1e-6) and b == pytest.approx(B, rel=1e-6)


def test_estimates_of_a_pack_and_what_the_budget_leaves_beside_it():
    sizer = ChunkSizer(0.05, 8192)
    assert sizer.estimate([(100, 0)]) == float("inf") and sizer.spare_seconds([(1, 0)]) < 0
    run_prompt(sizer, 3 * 8192)  # an exact fit
    pack = [(300, 0), (2000, 50_000)]
    assert sizer.estimate(pack) == pytest.approx(sum(cost(n, c) for n, c in pack), rel=1e-6)
    assert sizer.spare_seconds(pack) == pytest.approx(0.05 - sizer.estimate(pack))
