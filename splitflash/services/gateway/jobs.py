"""A request inside the gateway: what it asked for, what it has committed, its events."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitflash.services.common.spec_stats import SpecStats

if TYPE_CHECKING:
    from splitflash.services.gateway.links import WorkerLink


@dataclass(frozen=True)
class Tokens:
    ids: list[int]


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" | "length" | "abort"


@dataclass(frozen=True)
class Failed:
    status: int
    message: str
    code: str


@dataclass
class Job:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    spec_enabled: bool
    block_size: int
    created: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    pending_for_drafter: list[int] = field(default_factory=list)  # committed since last Propose
    drafter_generation: int = -1  # draft link generation the request was opened on
    # Placement (placement.py): the workers this request is pinned to, the verify link's
    # generation at prefill (a restart there loses the KV cache), verify workers tried.
    verify: WorkerLink | None = None
    verify_generation: int = -1
    draft: WorkerLink | None = None
    attempts: int = 0
    stats: SpecStats = field(default_factory=SpecStats)
    trace: deque = field(default_factory=lambda: deque(maxlen=4096))
    cancelled: bool = False  # client gone or stop string seen: release at the next step
    done: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None

    @property
    def base_len(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def remaining(self) -> int:
        return self.max_tokens - len(self.generated)
