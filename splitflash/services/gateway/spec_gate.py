"""The speculation gate: pause drafting while it makes decoding slower, not faster.

A speculative step costs a propose and a wider verify; it pays only if it commits enough
more tokens than a plain step. Where the drafter fails (commit_len ~1.00, as in the incident
behind splitflash, or the shipped DFlash drafter past its trained context), speculation is a
loss: on the H200 with the default model it decoded 457 tok/s against target-only 953 at
32k, and 302 against 492 at 185k (bench/RESULTS.md, session 18).

The gate measures both ways on live traffic. Per mode it keeps the last WINDOW steps and
compares pooled rates, tokens committed per request over seconds summed over the window,
never a mean or median of per-step rates (DESIGN.md §4): a drafter's commits per step are
skewed (many steps commit 1 or 2, a few commit many), and the first version of this gate,
comparing medians of per-step rates, paused DFlash at 1.4k and 8k on the H200, where it
decodes 1.35-1.41x as fast as plain steps (bench/RESULTS.md). A mode's first step is not
counted (it measures set-up: a CUDA graph captured, kernels autotuned), and a step counts
at most CLIP x the window's median step time (a pause, a hiccup).

The gate speculates first, judges after `min_steps` speculative steps (then runs plain
steps until it has both rates), pauses drafting only while plain decodes more than
(1 + MARGIN) x as fast (a marginal drafter keeps drafting), and every `probe_every` steps
tries the other mode once. A try that beats the favoured mode's rate is followed by another
(up to WINDOW in a row), so a drafter that recovers refills its window at once instead of
one try per `probe_every` steps; a try that loses costs one step.

Output does not change: greedy speculative and plain steps commit the same tokens, sampled
ones the same distribution. A paused step's requests are counted as fallback steps with
reason "unprofitable", and both rates are exported, so the decision shows on the
dashboards.

Pure logic, no I/O: the orchestrator asks `speculate()` before a step and `record()`s it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from splitflash.services.common.metric_math import GATE_MODES

SPECULATIVE, PLAIN = GATE_MODES
WINDOW = 32  # recent counted steps per mode behind its pooled rate
CLIP = 2.0  # a step counts at most this many times the window's median step time
MARGIN = 0.2  # drafting pauses only while plain decodes > (1 + MARGIN) x as fast


@dataclass
class _Mode:
    """One mode's recent steps: (tokens committed per request, seconds)."""

    steps: int = 0  # steps run in this mode, the uncounted first one included
    window: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    last_rate: float = 0.0  # the latest step's own tokens / seconds

    def add(self, tokens: float, seconds: float) -> None:
        self.steps += 1
        self.last_rate = tokens / seconds
        if self.steps > 1:  # the first one is set-up, not speed
            self.window.append((tokens, seconds))

    def rate(self) -> float | None:
        if not self.window:
            return None
        cap = CLIP * median(s for _, s in self.window)
        return sum(t for t, _ in self.window) / sum(min(s, cap) for _, s in self.window)


@dataclass
class SpecGate:
    probe_every: int = 32  # steps in the favoured mode between two tries of the other one
    min_steps: int = 16  # speculative steps measured before the first judgement
    modes: dict[str, _Mode] = field(default_factory=lambda: {m: _Mode() for m in GATE_MODES})
    since_probe: int = 0  # steps run in the favoured mode since the other one was tried
    trying: int = 0  # tries of the other mode in a row, the current one included

    def __post_init__(self) -> None:
        if self.probe_every < 1 or self.min_steps < 1:
            raise ValueError(
                f"probe_every and min_steps must be >= 1, got {self.probe_every}, {self.min_steps}"
            )

    @property
    def speculative_steps(self) -> int:
        return self.modes[SPECULATIVE].steps

    def rate(self, mode: str) -> float | None:
        """One request's decode speed in this mode, tokens/s (None: not measured yet)."""
        return self.modes[mode].rate()

    def speculate(self) -> bool:
        """Draft in the next step?"""
        if self.speculative_steps < self.min_steps:
            return True
        fast, plain = self.rate(SPECULATIVE), self.rate(PLAIN)
        if plain is None:  # both rates are needed to judge: plain steps until it has one
            return False
        favoured = SPECULATIVE if fast is not None and plain <= (1 + MARGIN) * fast else PLAIN
        other = PLAIN if favoured == SPECULATIVE else SPECULATIVE
        promising = self.modes[other].last_rate > self.modes[favoured].rate()
        if self.trying and promising and self.trying < WINDOW:
            self.trying += 1  # the last try beat the favoured mode: try again
            return other == SPECULATIVE
        self.trying = 0
        if self.since_probe >= self.probe_every:
            self.since_probe, self.trying = 0, 1
            return other == SPECULATIVE
        self.since_probe += 1
        return favoured == SPECULATIVE

    def record(self, drafted: bool, tokens_per_request: float, seconds: float) -> None:
        """A finished step: did any request draft, tokens committed per request (mean over
        the step's requests), its wall time."""
        if seconds <= 0 or tokens_per_request <= 0:
            return  # nothing committed (every request failed): says nothing of speed
        self.modes[SPECULATIVE if drafted else PLAIN].add(tokens_per_request, seconds)
