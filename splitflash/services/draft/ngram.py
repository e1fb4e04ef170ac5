"""n-gram (prompt lookup) drafter: continue the longest suffix n-gram seen earlier.

Needs no weights. For n from max_n down to min_n, find the most recent earlier occurrence of
the last n tokens in prompt + output and propose the tokens that followed it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NgramSettings:
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"n-gram range must satisfy 1 <= min_n <= max_n, got {self}")


DEFAULT_NGRAM = NgramSettings()


def propose_ngram(tokens: list[int], k: int, settings: NgramSettings = DEFAULT_NGRAM) -> list[int]:
    """Up to k draft tokens continuing `tokens`; [] when no suffix n-gram recurs."""
    if k <= 0:
        return []
    n_tokens = len(tokens)
    for n in range(min(settings.max_n, n_tokens - 1), settings.min_n - 1, -1):
        suffix = tokens[n_tokens - n :]
        # Latest earlier match first: recent context predicts the continuation best.
        for start in range(n_tokens - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


class NgramDrafter:
    """Per-request state for the n-gram drafter: the tokens seen so far."""

    name = "ngram"

    def __init__(self, settings: NgramSettings = DEFAULT_NGRAM) -> None:
        self.settings = settings
        self.tokens: dict[str, list[int]] = {}

    def open(self, request_id: str, prompt_ids: list[int]) -> None:
        self.tokens[request_id] = list(prompt_ids)

    def extend(self, request_id: str, new_ids: list[int], base_len: int) -> None:
        """Add tokens committed since the last call; base_len is the new committed length."""
        seen = self.tokens[request_id]
        seen.extend(new_ids)
        if len(seen) != base_len:
            raise ValueError(
                f"drafter out of step for {request_id!r}: has {len(seen)} tokens, "
                f"target committed {base_len}"
            )

    def propose(self, request_id: str, k: int) -> list[int]:
        return propose_ngram(self.tokens[request_id], k, self.settings)

    def release(self, request_id: str) -> None:
        self.tokens.pop(request_id, None)
