"""Pooled speculative-decoding statistics (DESIGN.md §4): sums, never averages of averages."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    steps: int = 0
    draft_tokens: int = 0  # sum K
    accepted_drafts: int = 0  # sum a
    committed: int = 0  # sum c
    truncated_steps: int = 0
    accepted_at: list[int] = field(default_factory=list)  # steps with a > i
    drafted_at: list[int] = field(default_factory=list)  # steps that drafted depth i

    def record(self, draft_tokens: int, max_depth: int, accepted: int, commit_len: int) -> None:
        """One verify step. max_depth: deepest drafted node (chain: K)."""
        self.steps += 1
        self.draft_tokens += draft_tokens
        self.accepted_drafts += accepted
        self.committed += commit_len
        if commit_len < accepted + 1:
            self.truncated_steps += 1
        grow = max(max_depth, accepted) - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(max_depth):
            self.drafted_at[i] += 1
        for i in range(accepted):
            self.accepted_at[i] += 1

    def merge(self, other: SpecStats) -> None:
        for name in ("steps", "draft_tokens", "accepted_drafts", "committed", "truncated_steps"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("accepted_at", "drafted_at"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    @property
    def mean_commit_len(self) -> float:
        return self.committed / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_drafts / self.draft_tokens if self.draft_tokens else 0.0

    def accepted_per_position(self) -> list[float]:
        """Position i: steps with a > i over steps that drafted a node at depth i."""
        return [
            round(acc / drafted, 6) if drafted else 0.0
            for acc, drafted in zip(self.accepted_at, self.drafted_at, strict=True)
        ]

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
