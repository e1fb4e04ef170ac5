"""How the speculative counters pool: the math the dashboards compute from the counters.

tests/unit/test_metrics.py evaluates the dashboards' PromQL on synthetic counters and
compares with these functions, and the response's `speculative_decoding_stats`
(spec_stats.py) is built on them, so a response and a dashboard cannot drift apart.

Terms (DESIGN.md §4): K = draft_tokens, a = accepted_drafts, c = commit_len.
Pooled figures only, never averages of per-request averages:
  mean commit_len = sum(c) / steps, acceptance rate = sum(a) / sum(K),
  acceptance at position i = steps with a > i / steps that drafted a node at position i.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


def _add_positions(counts: tuple[int, ...], n: int) -> tuple[int, ...]:
    """counts with 1 added at positions 0..n-1, grown as needed."""
    grown = counts + (0,) * max(0, n - len(counts))
    return tuple(v + 1 if i < n else v for i, v in enumerate(grown))


def _sum_positions(x: tuple[int, ...], y: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(x), len(y))
    x, y = x + (0,) * (n - len(x)), y + (0,) * (n - len(y))
    return tuple(p + q for p, q in zip(x, y, strict=True))


@dataclass(frozen=True)
class SpecTotals:
    """Pooled counts over any set of steps (one request, one batch, a whole server)."""

    steps: int = 0
    draft_tokens: int = 0  # sum(K)
    accepted_drafts: int = 0  # sum(a)
    committed_tokens: int = 0  # sum(c)
    accepted_per_pos: tuple[int, ...] = ()  # [i] = steps with a > i
    drafted_per_pos: tuple[int, ...] = ()  # [i] = steps that drafted a node at position i

    def add(self, draft_tokens: int, max_depth: int, accepted: int, commit_len: int) -> SpecTotals:
        """These totals plus one request-step; max_depth = deepest drafted node (chain: K).

        A plain target step without drafts counts too (K = 0, c = 1): it is a verify step and
        its token is streamed, so leaving it out would break tokens streamed == sum(c).
        """
        return SpecTotals(
            steps=self.steps + 1,
            draft_tokens=self.draft_tokens + draft_tokens,
            accepted_drafts=self.accepted_drafts + accepted,
            committed_tokens=self.committed_tokens + commit_len,
            accepted_per_pos=_add_positions(self.accepted_per_pos, accepted),
            drafted_per_pos=_add_positions(self.drafted_per_pos, max_depth),
        )

    def merge(self, other: SpecTotals) -> SpecTotals:
        """Pool two sets of steps (e.g. two requests) by adding their counts."""
        return SpecTotals(
            steps=self.steps + other.steps,
            draft_tokens=self.draft_tokens + other.draft_tokens,
            accepted_drafts=self.accepted_drafts + other.accepted_drafts,
            committed_tokens=self.committed_tokens + other.committed_tokens,
            accepted_per_pos=_sum_positions(self.accepted_per_pos, other.accepted_per_pos),
            drafted_per_pos=_sum_positions(self.drafted_per_pos, other.drafted_per_pos),
        )


def pool(parts: Iterable[SpecTotals]) -> SpecTotals:
    """Pooled totals of many requests: counts are added, never their ratios averaged."""
    total = SpecTotals()
    for part in parts:
        total = total.merge(part)
    return total


def mean_commit_len(t: SpecTotals) -> float:
    """sum(c) / steps: tokens committed per verify step, bonus included (0.0 with no steps)."""
    return t.committed_tokens / t.steps if t.steps else 0.0


def acceptance_rate(t: SpecTotals) -> float:
    """sum(a) / sum(K): fraction of proposed draft tokens accepted (0.0 with no drafts)."""
    return t.accepted_drafts / t.draft_tokens if t.draft_tokens else 0.0


def per_position_acceptance(t: SpecTotals) -> tuple[float, ...]:
    """[i] = steps with a > i / steps that drafted position i (0.0 where none drafted)."""
    accepted = t.accepted_per_pos + (0,) * (len(t.drafted_per_pos) - len(t.accepted_per_pos))
    return tuple(
        (acc / drafted if drafted else 0.0)
        for acc, drafted in zip(accepted, t.drafted_per_pos, strict=False)
    )
