"""What a diagnosis says (`Finding`) and what it knows of the drafter (`PolicyInfo`).

Pure data and parsing: no sockets, no clocks. `PolicyInfo` is built from what a running
deployment exposes (the gateway's `/ready` body has `draft.info = {drafter, policy}`, the
draft service's metrics have the policy-mismatch gauge and the sliding keys bound), so a
rule can say "5 of 6 drafter layers are sliding" without reading the checkpoint itself.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

SEVERITIES = ("critical", "warning")


@dataclass(frozen=True)
class Finding:
    code: str  # stable identifier, e.g. "commit_len_stuck" (tests and tools match on it)
    message: str  # plain words: what is seen, then the likely cause
    severity: str = "warning"  # "critical" | "warning"

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def to_dict(self) -> dict:
        return asdict(self)


# The drafter's policy string (splitflash/models/dflash/policy.py: policy_string), e.g.
#   "5 of 6 layers sliding (window 2048), 1 full; block non-causal; block_size 16"
#   "0 of 6 layers sliding, 6 full [window_override=off: 5 checkpoint sliding layer(s) of
#    window 2048 run FULL attention]; ..."
_IN_FORCE = re.compile(r"(\d+) of (\d+) layers sliding(?: \(window (\d+)\))?")
_FORCED = re.compile(r"window_override=off: (\d+) checkpoint sliding layer\(s\) of window (\d+)")


@dataclass(frozen=True)
class PolicyInfo:
    drafter: str = ""  # "dflash", "ngram", "garbage", "none", "" = unknown
    policy: str = ""  # the policy string as exported ("" = drafter without attention)
    layers: int = 0  # drafter layers (0 = unknown / no attention)
    sliding_in_force: int = 0  # layers whose window is applied
    sliding_in_checkpoint: int = 0  # layers the checkpoint declares sliding
    window: int = 0  # W of the checkpoint's sliding layers (0 = none)
    window_off: bool = False  # an override forced the checkpoint's sliding layers to full
    mismatch: bool | None = None  # draft metrics' policy-mismatch gauge (None = not scraped)
    sliding_keys_bound: float | None = None  # most keys one draft may read on sliding layers

    @property
    def window_not_in_force(self) -> bool:
        """The checkpoint declares sliding layers whose window is not applied."""
        return self.sliding_in_checkpoint > self.sliding_in_force or bool(
            self.window_off and self.sliding_in_checkpoint
        )

    def describe(self) -> str:
        """'5 of 6 drafter layers are sliding (window 2048)' from the checkpoint's view."""
        if not self.layers:
            return f"drafter {self.drafter or 'unknown'} has no attention layers"
        return (
            f"{self.sliding_in_checkpoint} of {self.layers} drafter layers are sliding "
            f"(window {self.window})"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def parse_policy(
    drafter: str,
    policy: str,
    mismatch: bool | None = None,
    sliding_keys_bound: float | None = None,
) -> PolicyInfo:
    """PolicyInfo from the exported policy string (unknown formats give zeros, not errors:
    a doctor must still run against a drafter that says nothing about its attention)."""
    in_force = _IN_FORCE.search(policy or "")
    forced = _FORCED.search(policy or "")
    sliding = int(in_force.group(1)) if in_force else 0
    layers = int(in_force.group(2)) if in_force else 0
    n_forced = int(forced.group(1)) if forced else 0
    window = int(forced.group(2)) if forced else 0
    if in_force and in_force.group(3):
        window = int(in_force.group(3))
    return PolicyInfo(
        drafter=drafter,
        policy=policy or "",
        layers=layers,
        sliding_in_force=sliding,
        sliding_in_checkpoint=sliding + n_forced,
        window=window,
        window_off=bool(forced) or "window_override=off" in (policy or ""),
        mismatch=mismatch,
        sliding_keys_bound=sliding_keys_bound,
    )
