"""Gateway settings (env prefix SPLITFLASH_GATEWAY_)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    verify_addr: str = "tcp://127.0.0.1:5555"
    draft_addr: str = "tcp://127.0.0.1:5556"  # "" = no drafter: plain target decoding
    target: str = "smollm2-135m"  # for the tokenizer and chat template
    model_name: str = "smollm2-135m"  # the `model` field clients send and /v1/models shows
    max_context: int = 8192
    max_running: int = 16  # requests in one step (continuous batching)
    max_waiting: int = 64  # queued beyond that get 429
    block_size: int = 8  # default draft block (anchor + drafts)
    max_block_size: int = 16
    default_max_tokens: int = 256
    draft_timeout_s: float = 2.0  # a drafter later than this: the step runs without drafts
    verify_timeout_s: float = 60.0
    heartbeat_s: float = 1.0
    trace_requests: int = 256  # per-request traces kept in memory (most recent)
    api_keys: tuple[str, ...] = ()  # empty = no authentication

    def __post_init__(self) -> None:
        if not 2 <= self.block_size <= self.max_block_size:
            raise ValueError(f"block_size {self.block_size} outside 2..{self.max_block_size}")
        if self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
