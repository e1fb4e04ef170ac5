"""The speculation gate: pause drafting while it makes decoding slower, not faster.

A speculative step costs a propose and a wider verify; it pays only if it commits enough
more tokens than a plain step. Where the drafter fails (commit_len ~1.00, as in the incident
behind splitflash, or the shipped DFlash drafter past its trained context), speculation is a
loss: on the H200 with the default model it decoded 457 tok/s against target-only 953 at
32k, and 302 against 492 at 185k (bench/RESULTS.md, session 18).

The gate measures both ways on live traffic. Per mode it keeps the last WINDOW steps, and a
mode's rate is the mean of their tokens committed per request over the median of their
step times. Tokens are pooled, never a mean or median of per-step rates (DESIGN.md §4): a
drafter's commits per step are skewed (many steps commit 1 or 2, a few commit many), and
the first version of this gate, comparing medians of per-step rates, paused DFlash at
1.4k and 8k on the H200, where it decodes 1.35-1.41x as fast as plain steps
(bench/RESULTS.md). Step times take the median because within a mode they are nearly
constant (the same graphs replayed) but for outliers: a graph captured, autotuning, a
pause. A step counts only when the step before it ran in the same mode: the first step
after a switch pays for the switch (a drafter ingesting the context it skipped: on the H200
a DFlash proposal after 32 / 256 plain steps takes 2.2 / 3.0 ms instead of 1.0), not for
the mode.

The gate speculates first and judges after `min_steps` speculative steps; to judge it must
measure plain steps, so it tries them. A try of a mode is one switch step (not counted) and
TRY_STEPS counted steps, and it starts from an empty window for that mode: what the mode did
before the try is stale, or the gate would not be trying it. The try is judged on its steps
pooled, never on one step: one speculative step commits 1 token or 8, and judging tries by
a single step (the gate's v3) lost most tries of a drafter that wins on average, so on the
H100 it paused DFlash at 1.4k, where it decodes 1.13x as fast as plain steps (session 23).
Drafting pauses only while plain decodes more than (1 + MARGIN) x as fast (a marginal
drafter keeps drafting). Between tries the favoured mode's window goes on, and if its rate
falls below the other's the gate switches at once (a drafter that starts failing). After
`probe_every` steps in the favoured mode the gate tries the other one; a try that loses
doubles the wait before the next, up to MAX_BACKOFF x `probe_every` steps; a try that wins
makes its mode the favoured one, and the wait is back to `probe_every`.

Output does not change: greedy speculative and plain steps commit the same tokens, sampled
ones the same distribution. A paused step's requests are counted as fallback steps with
reason "unprofitable", and both rates are exported, so the decision shows on the
dashboards.

Pure logic, no I/O: the orchestrator asks `speculate()` before a step and `record()`s it,
keeping one gate per context bucket (`ContextGates`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from splitflash.services.common.metric_math import GATE_MODES, context_bucket

SPECULATIVE, PLAIN = GATE_MODES
WINDOW = 16  # recent counted steps per mode behind its pooled rate
TRY_STEPS = 4  # counted steps of a try of the other mode, after its switch step
MARGIN = 0.2  # drafting pauses only while plain decodes > (1 + MARGIN) x as fast
MAX_BACKOFF = 8  # the wait between losing tries grows up to this many x probe_every


@dataclass
class _Mode:
    """One mode's recent counted steps: (tokens committed per request, seconds)."""

    window: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps: int = 0  # steps run in this mode, uncounted ones included

    def add(self, tokens: float, seconds: float, counted: bool) -> None:
        self.steps += 1
        if counted:
            self.window.append((tokens, seconds))

    def rate(self) -> float | None:
        if not self.window:
            return None
        tokens = sum(t for t, _ in self.window) / len(self.window)
        return tokens / median(s for _, s in self.window)


@dataclass
class SpecGate:
    probe_every: int = 32  # steps in the favoured mode between two tries of the other one
    min_steps: int = 16  # speculative steps measured before the first judgement
    modes: dict[str, _Mode] = field(default_factory=lambda: {m: _Mode() for m in GATE_MODES})
    since_probe: int = 0  # steps run in the favoured mode since the last try
    wait: int = 0  # favoured steps before the next try (probe_every, doubled per lost try)
    favoured: str | None = None  # the mode the last judgement favoured (None: not judged)
    tried: str = PLAIN  # the mode of the current or last try
    trying: int = 0  # steps of the current try so far (0: none)
    last_mode: str | None = None  # the mode of the last recorded step

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

    def _judge(self) -> str:
        """The mode the rates favour: plain only while > (1 + MARGIN) x as fast."""
        fast, plain = self.rate(SPECULATIVE), self.rate(PLAIN)
        if plain is None or (fast is not None and plain <= (1 + MARGIN) * fast):
            return SPECULATIVE
        return PLAIN

    def _try(self, mode: str) -> bool:
        self.tried, self.trying = mode, 1
        self.modes[mode].window.clear()
        return mode == SPECULATIVE

    def speculate(self) -> bool:
        """Draft in the next step?"""
        if self.speculative_steps < self.min_steps:
            return True
        if self.trying:
            if self.trying < 1 + TRY_STEPS:
                self.trying += 1
                return self.tried == SPECULATIVE
            self.trying = 0
            verdict = self._judge()
            won = verdict == self.tried or self.favoured is None  # the first judgement
            cap = MAX_BACKOFF * self.probe_every
            self.wait = self.probe_every if won else min(2 * self.wait, cap)
            self.favoured, self.since_probe = verdict, 0
        elif self.favoured is None:  # the first judgement needs plain steps: try them
            return self._try(PLAIN)
        elif (verdict := self._judge()) != self.favoured:  # the favoured mode fell behind
            self.favoured, self.wait, self.since_probe = verdict, self.probe_every, 0
        if self.since_probe >= self.wait:
            return self._try(PLAIN if self.favoured == SPECULATIVE else SPECULATIVE)
        self.since_probe += 1
        return self.favoured == SPECULATIVE

    def record(self, drafted: bool, tokens_per_request: float, seconds: float) -> None:
        """A finished step: did any request draft, tokens committed per request (mean over
        the step's requests), its wall time."""
        if seconds <= 0 or tokens_per_request <= 0:
            return  # nothing committed (every request failed): says nothing of speed
        mode = SPECULATIVE if drafted else PLAIN
        self.modes[mode].add(tokens_per_request, seconds, counted=mode == self.last_mode)
        self.last_mode = mode


@dataclass
class ContextGates:
    """One gate per context bucket, chosen by a step's longest request. A step's time and a
    drafter's acceptance both change with context (the shipped DFlash drafter wins 1.35x at
    1.4k and loses 0.5x at 32k on the H200), so one gate over a mixed workload would weigh
    plain steps at one context against speculative ones at another, and make one decision
    for contexts that want opposite ones."""

    probe_every: int = 32
    gates: dict[str, SpecGate] = field(default_factory=dict)  # {context_bucket: its gate}

    def for_context(self, n_tokens: int) -> tuple[str, SpecGate]:
        """The bucket of a step whose longest request holds n_tokens, and its gate."""
        bucket = context_bucket(n_tokens)
        if bucket not in self.gates:
            self.gates[bucket] = SpecGate(self.probe_every)
        return bucket, self.gates[bucket]
