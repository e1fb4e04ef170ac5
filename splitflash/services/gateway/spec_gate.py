"""The speculation gate: pause drafting while it makes decoding slower, not faster.

A speculative step costs a propose and a wider verify; it pays only if it commits enough
more tokens than a plain step. Where the drafter fails (commit_len ~1.00, as in the incident
behind splitflash, or the shipped DFlash drafter past its trained context), speculation is a
loss: on the H200 with the default model it decoded 457 tok/s against target-only 953 at
32k, and 302 against 492 at 185k (bench/RESULTS.md, session 18).

The gate measures both ways on live traffic. A step's rate is the tokens it committed per
request over its wall time (one request's decode speed), kept per mode as the median of the
last WINDOW steps of that mode (robust to a one-off slow step: a graph capture, a GC
pause). It speculates first, judges after `min_steps` speculative steps (then tries one
plain step to have both rates), runs whichever mode is faster, and every `probe_every`
steps tries the other mode once, so it follows a context that grows and a drafter that
recovers. Output does not change: greedy speculative and plain steps commit the same
tokens, sampled ones the same distribution. A paused step's requests are counted as
fallback steps with reason "unprofitable", and both rates are exported, so the
decision shows on the dashboards.

Pure logic, no I/O: the orchestrator asks `speculate()` before a step and `record()`s it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median

from splitflash.services.common.metric_math import GATE_MODES

SPECULATIVE, PLAIN = GATE_MODES
WINDOW = 5  # recent steps per mode whose median is the mode's rate


@dataclass
class SpecGate:
    probe_every: int = 32  # steps in the faster mode between two tries of the other one
    min_steps: int = 8  # speculative steps measured before the first judgement
    samples: dict[str, deque[float]] = field(
        default_factory=lambda: {mode: deque(maxlen=WINDOW) for mode in GATE_MODES}
    )  # tokens per request per second of recent steps, by mode
    speculative_steps: int = 0
    since_probe: int = 0  # steps run in the faster mode since the other one was last tried

    def __post_init__(self) -> None:
        if self.probe_every < 1 or self.min_steps < 1:
            raise ValueError(
                f"probe_every and min_steps must be >= 1, got {self.probe_every}, {self.min_steps}"
            )

    def rate(self, mode: str) -> float | None:
        """One request's decode speed in this mode, tokens/s (None: not measured yet)."""
        recent = self.samples[mode]
        return median(recent) if recent else None

    def speculate(self) -> bool:
        """Draft in the next step?"""
        if self.speculative_steps < self.min_steps:
            return True
        fast, plain = self.rate(SPECULATIVE), self.rate(PLAIN)
        if plain is None:  # both rates are needed to judge: one plain step
            return False
        faster_is_spec = fast is not None and fast >= plain
        if self.since_probe >= self.probe_every:
            self.since_probe = 0
            return not faster_is_spec
        self.since_probe += 1
        return faster_is_spec

    def record(self, drafted: bool, tokens_per_request: float, seconds: float) -> None:
        """A finished step: did any request draft, tokens committed per request (mean over
        the step's requests), its wall time."""
        if seconds <= 0 or tokens_per_request <= 0:
            return  # nothing committed (every request failed): says nothing of speed
        self.samples[SPECULATIVE if drafted else PLAIN].append(tokens_per_request / seconds)
        if drafted:
            self.speculative_steps += 1
