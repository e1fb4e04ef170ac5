"""Pooled speculative-decoding statistics of one request or one run (DESIGN.md §4).

A mutable accumulator over `spec_totals.SpecTotals`, so responses, the CLI and the
dashboards share one implementation of the pooled math (sums, never averages of averages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitflash.services.common.spec_totals import (
    SpecTotals,
    acceptance_rate,
    mean_commit_len,
    per_position_acceptance,
)


@dataclass
class SpecStats:
    totals: SpecTotals = field(default_factory=SpecTotals)

    def record(self, draft_tokens: int, max_depth: int, accepted: int, commit_len: int) -> None:
        """One verify step. max_depth: deepest drafted node (chain: K)."""
        self.totals = self.totals.add(draft_tokens, max_depth, accepted, commit_len)

    def merge(self, other: SpecStats) -> None:
        self.totals = self.totals.merge(other.totals)

    @property
    def steps(self) -> int:
        return self.totals.steps

    @property
    def draft_tokens(self) -> int:
        return self.totals.draft_tokens

    @property
    def accepted_drafts(self) -> int:
        return self.totals.accepted_drafts

    @property
    def committed(self) -> int:
        return self.totals.committed_tokens

    @property
    def mean_commit_len(self) -> float:
        return mean_commit_len(self.totals)

    @property
    def acceptance_rate(self) -> float:
        return acceptance_rate(self.totals)

    def accepted_per_position(self) -> list[float]:
        return [round(v, 6) for v in per_position_acceptance(self.totals)]

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_drafts": self.accepted_drafts,
            "mean_commit_len": round(self.mean_commit_len, 6),
            "acceptance_rate": round(self.acceptance_rate, 6),
            "accepted_per_position": self.accepted_per_position(),
        }


def step_invariants(
    draft_tokens: int, max_depth: int, accepted: int, depth: int, commit_len: int, finished: bool
) -> list[str]:
    """DESIGN.md §4 on one step; the names of the broken invariants (empty when sound)."""
    broken = []
    if not 0 <= accepted <= max_depth:
        broken.append("accepted_range")
    if depth != accepted:
        broken.append("depth_equals_accepted")
    if commit_len > accepted + 1 or (not finished and commit_len != accepted + 1):
        broken.append("commit_len")
    if accepted > draft_tokens:
        broken.append("accepted_le_drafted")
    return broken
