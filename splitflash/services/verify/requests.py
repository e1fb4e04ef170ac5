"""A request's decoding state on the target (Sequence) and what a prefill or verify step
reports for it (StepReport): shared by the engine and its prompt runs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitflash.services.verify.acceptance import StepOutcome
from splitflash.services.verify.sampling import Sampling


@dataclass
class Sequence:
    request_id: str
    tokens: list[int]  # committed tokens: prompt + generated
    sampling: Sampling
    generator: torch.Generator
    stop_ids: frozenset[int]


@dataclass
class StepReport:
    request_id: str
    outcome: StepOutcome | None
    committed_len: int  # after the step
    violations: list[str] = field(default_factory=list)
    features: torch.Tensor | None = None  # [a+1 (or prompt len), F] of the kept positions
    feature_start: int = 0  # position of the first feature row
    finished: bool = False
    error: str | None = None
