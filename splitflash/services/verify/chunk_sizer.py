"""How many prompt tokens the next prefill chunk takes when running streams wait for it.

Between two steps of a running request the verify loop runs one chunk of a long prompt
(prefill_job.py), so each step of every running stream waits up to one chunk's forward. In
tokens alone a chunk's time grows with the context it attends to: 8192 tokens took 0.06 s
at 32k and 0.27 s at 185k for the default model on an H100 (bench/RESULTS.md), and a
stream's inter-token latency with it. VerifySettings.prefill_chunk_ms bounds that time:
while other requests are decoding, each chunk is sized so its forward takes about that long,
from a cost model fitted to the chunks run so far in this process:

    seconds(n tokens after c cached) = a * n + b * n * (c + n / 2)

(a: the per-token work of the linears; b: attention's, whose keys per query average c + n/2
over a causal chunk). Short prompts keep big chunks, long ones shrink as they grow. With no
one waiting, chunks are prefill_chunk tokens (throughput). Pure: the caller times chunks.
"""

from __future__ import annotations

import math
from collections import deque

MIN_CHUNK = 256  # never fewer prompt tokens a chunk: a prompt must progress at a sane rate
HISTORY = 64  # chunks the fit uses (the latest: load and clocks drift)
OUTLIER = 4.0  # a chunk this many times slower than the others' fit says is left out


class ChunkSizer:
    def __init__(self, budget_s: float, max_tokens: int, min_tokens: int = MIN_CHUNK) -> None:
        if budget_s <= 0 or max_tokens < 1:
            raise ValueError(f"need budget_s > 0 and max_tokens >= 1, got {budget_s}, {max_tokens}")
        self.budget_s = budget_s
        self.max_tokens = max_tokens
        self.min_tokens = max(1, min(min_tokens, max_tokens))
        self._seen: deque[tuple[float, float, float]] = deque(maxlen=HISTORY)  # (x_a, x_b, s)
        # coefficients() of _seen, kept until the next observation: a packed chunk asks for
        # it once for its size, once for its spare budget and once per candidate partner
        self._fit: tuple[float, float] | None = None

    def observe(self, tokens: int, cached: int, seconds: float) -> None:
        """A chunk of `tokens` after `cached` prompt tokens took `seconds`."""
        self.observe_pack([(tokens, cached)], seconds)

    def observe_pack(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        """One forward of several prompts' chunks, (tokens, cached) each, took `seconds`:
        the model's terms add up over them."""
        tokens, attended = _terms(chunks)
        if tokens >= 1 and seconds > 0 and math.isfinite(seconds):
            self._seen.append((tokens, attended, seconds))
            self._fit = None

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) >= 0 of the least-squares fit, or None before any chunk was seen. One chunk
        far slower than the fit of the others says (a first call's compile, a GPU shared for
        a moment) is left out: kept, it would shrink the next HISTORY chunks."""
        if not self._seen:
            return None
        if self._fit is None:
            self._fit = _fit_without_outlier(list(self._seen))
        return self._fit

    def estimate(self, chunks: list[tuple[int, int]]) -> float:
        """Seconds the fit says one forward of these (tokens, cached) chunks takes; inf
        before any chunk was seen."""
        fit = self.coefficients()
        if fit is None:
            return math.inf
        x_a, x_b = _terms(chunks)
        return fit[0] * x_a + fit[1] * x_b

    def spare_seconds(self, chunks: list[tuple[int, int]]) -> float:
        """What the budget leaves beside these chunks in one forward (<= 0: nothing)."""
        return self.budget_s - self.estimate(chunks)

    def tokens(self, cached: int, others_waiting: bool) -> int:
        """Prompt tokens for the chunk after `cached`: prefill_chunk unless requests wait."""
        fit = self.coefficients() if others_waiting else None
        if fit is None:
            return self.max_tokens
        a, b = fit
        # a n + b n (c + n / 2) = budget  ->  (b / 2) n^2 + (a + b c) n - budget = 0
        linear = a + b * cached
        if b > 0:
            n = (math.sqrt(linear * linear + 2 * b * self.budget_s) - linear) / b
        elif a > 0:
            n = self.budget_s / a
        else:
            return self.max_tokens  # chunks that cost nothing measurable
        return int(min(self.max_tokens, max(self.min_tokens, n)))


def _terms(chunks: list[tuple[int, int]]) -> tuple[float, float]:
    """(x_a, x_b) of one forward over (tokens, cached) chunks: tokens, and keys attended."""
    return float(sum(n for n, _ in chunks)), float(sum(n * (c + n / 2) for n, c in chunks))


def _cost(a: float, b: float, seen: tuple[float, float, float]) -> float:
    return max(a * seen[0] + b * seen[1], 1e-12)


def _fit_without_outlier(seen: list[tuple[float, float, float]]) -> tuple[float, float]:
    a, b = _fit(seen)
    if len(seen) >= 3:
        worst = max(range(len(seen)), key=lambda i: seen[i][2] / _cost(a, b, seen[i]))
        rest = seen[:worst] + seen[worst + 1 :]
        a_r, b_r = _fit(rest)
        if seen[worst][2] > OUTLIER * _cost(a_r, b_r, seen[worst]):
            return a_r, b_r
    return a, b


def _fit(seen: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of seconds = a x_a + b x_b over (x_a, x_b, seconds); a, b >= 0."""
    saa = sab = sbb = say = sby = 0.0
    for xa, xb, y in seen:
        saa, sab, sbb = saa + xa * xa, sab + xa * xb, sbb + xb * xb
        say, sby = say + xa * y, sby + xb * y
    det = saa * sbb - sab * sab
    if det > 1e-9 * saa * sbb:  # chunks at different context-to-size ratios
        a, b = (say * sbb - sby * sab) / det, (sby * saa - say * sab) / det
        if a >= 0 and b >= 0:
            return a, b
    # One ratio seen so far (or a negative term): the one-term fit that explains more; on a
    # tie attention's, whose chunks shrink as the context grows (the linears' alone would
    # keep them as big and overrun the budget at long context).
    b_only, a_only = sby / sbb, say / saa
    err_b = sum((y - b_only * xb) ** 2 for _, xb, y in seen)
    err_a = sum((y - a_only * xa) ** 2 for xa, _, y in seen)
    return (0.0, b_only) if err_b <= err_a else (a_only, 0.0)
