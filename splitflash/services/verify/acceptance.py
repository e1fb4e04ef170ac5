"""Chain and tree acceptance: which drafted tokens the target keeps, and the step's figures.

Pure functions over tensors. Greedy accepts the longest path on which every draft equals the
target's argmax, then appends the target's own token (bonus or correction). Sampling uses
rejection sampling (Leviathan et al.), which leaves the target distribution unchanged: a
draft x drawn from q is kept with probability min(1, p(x)/q(x)); on rejection the correction
is drawn from norm(max(p - q, 0)). A deterministic drafter (n-gram, argmax DFlash) has q
one-hot, so x is kept with probability p(x) and the correction comes from p with x removed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitflash.services.common.spec_stats import step_invariants


@dataclass(frozen=True)
class StepOutcome:
    committed: list[int]  # accepted drafts + one bonus/correction token
    accepted_drafts: int  # a
    accepted_depth: int  # d (root = 0)
    draft_tokens: int  # K
    path: list[int]  # block indices (1-based node ids) of the accepted drafts, in depth order

    @property
    def commit_len(self) -> int:
        return len(self.committed)


def accept_chain_greedy(draft: list[int], logits: torch.Tensor) -> StepOutcome:
    """draft [K]; logits [K+1, V]: row i is the target after the anchor and i drafts."""
    return accept_greedy_ids(draft, logits.argmax(dim=-1).tolist())


def accept_greedy_ids(draft: list[int], target: list[int]) -> StepOutcome:
    """Greedy chain acceptance from the target's argmax ids [K+1] (host ints)."""
    a = 0
    while a < len(draft) and draft[a] == target[a]:
        a += 1
    return StepOutcome(draft[:a] + [target[a]], a, a, len(draft), list(range(1, a + 1)))


def accept_chain_sampled(
    draft: list[int],
    probs: torch.Tensor,
    gen: torch.Generator,
    draft_probs: torch.Tensor | None = None,
) -> StepOutcome:
    """probs [K+1, V] target; draft_probs [K, V] or None for a deterministic drafter."""
    for i, token in enumerate(draft):
        p = probs[i]
        q_x = 1.0 if draft_probs is None else float(draft_probs[i, token])
        accept_p = 1.0 if q_x <= 0 else min(1.0, float(p[token]) / q_x)
        if torch.rand((), generator=gen).item() < accept_p:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[token] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        if residual.sum() <= 0:  # p was one-hot on the draft: nothing else to draw
            residual = p
        nxt = int(torch.multinomial(residual / residual.sum(), 1, generator=gen))
        return StepOutcome(draft[:i] + [nxt], i, i, len(draft), list(range(1, i + 1)))
    bonus = int(torch.multinomial(probs[len(draft)], 1, generator=gen))
    k = len(draft)
    return StepOutcome(draft + [bonus], k, k, k, list(range(1, k + 1)))


def truncate_outcome(outcome: StepOutcome, max_commit: int, stop_ids: set[int]) -> StepOutcome:
    """Cut the committed tokens at the first stop token (kept) or at max_commit."""
    keep = min(len(outcome.committed), max(0, max_commit))
    for i, token in enumerate(outcome.committed[:keep]):
        if token in stop_ids:
            keep = i + 1
            break
    if keep == len(outcome.committed):
        return outcome
    return StepOutcome(
        outcome.committed[:keep],
        outcome.accepted_drafts,
        outcome.accepted_depth,
        outcome.draft_tokens,
        outcome.path,
    )


def check_invariants(outcome: StepOutcome, max_depth: int, finished: bool) -> list[str]:
    """DESIGN.md §4 on one step; returns the names of the broken invariants."""
    return step_invariants(
        outcome.draft_tokens,
        max_depth,
        outcome.accepted_drafts,
        outcome.accepted_depth,
        outcome.commit_len,
        finished,
    )
