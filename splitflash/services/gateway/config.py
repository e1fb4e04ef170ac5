"""Gateway settings (env prefix SPLITFLASH_GATEWAY_)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GatewaySettings:
    host: str = "127.0.0.1"
    port: int = 8000
    verify_addr: str = "tcp://127.0.0.1:5555"  # one worker; `verify_addrs` wins when set
    draft_addr: str = "tcp://127.0.0.1:5556"  # "" = no drafter: plain target decoding
    # Several workers (comma-separated). A host name stands for every address it resolves
    # to (compose `--scale verify=2`): one link per IP, re-resolved every discovery_s.
    verify_addrs: tuple[str, ...] = ()
    draft_addrs: tuple[str, ...] = ()
    discovery_s: float = 5.0
    # A verify worker lost mid-request: a request with no token streamed yet is retried
    # from its prompt elsewhere; one with tokens streamed is resumed elsewhere from prompt +
    # streamed tokens when `resume_streamed` and it is greedy or unseeded (a seeded sample
    # would silently stop matching its seed), else it fails with 503. At most
    # `max_attempts` verify workers per request, so a request that kills workers stops.
    resume_streamed: bool = True
    max_attempts: int = 3
    target: str = "smollm2-135m"  # for the tokenizer and chat template
    model_name: str = "smollm2-135m"  # the `model` field clients send and /v1/models shows
    max_context: int = 8192
    max_running: int = 16  # requests in one step (continuous batching)
    max_waiting: int = 64  # queued beyond that get 429
    block_size: int = 8  # default draft block (anchor + drafts)
    max_block_size: int = 16
    default_max_tokens: int = 256
    draft_timeout_s: float = 2.0  # a drafter later than this: the step runs without drafts
    # The speculation gate (spec_gate.py): drafting pauses while plain steps decode faster
    # (fallback reason "unprofitable"); the slower mode is tried every spec_probe_every
    # steps. False: draft at every step, whatever it costs.
    spec_gate: bool = True
    spec_probe_every: int = 32
    verify_timeout_s: float = 60.0
    # A Prefill may take verify_timeout_s plus its prompt tokens at this rate: the slowest
    # prefill a live verify worker is allowed (verify runs a long prompt a chunk at a time
    # between the other requests' steps; a 185k prompt gets 60 + 370 s at the default).
    prefill_tokens_per_s: float = 500.0
    heartbeat_s: float = 1.0
    trace_requests: int = 256  # per-request traces kept in memory (most recent)
    api_keys: tuple[str, ...] = ()  # empty = no authentication
    # CURVE towards the workers (protocol/security.py): the gateway's secret key and the
    # workers' public keys, inline (Z85) or as files. All empty = plain TCP.
    curve_secret_key: str = ""
    curve_secret_key_file: str = ""
    verify_server_key: str = ""
    verify_server_key_file: str = ""
    draft_server_key: str = ""
    draft_server_key_file: str = ""

    def __post_init__(self) -> None:
        if not 2 <= self.block_size <= self.max_block_size:
            raise ValueError(f"block_size {self.block_size} outside 2..{self.max_block_size}")
        if self.max_running < 1 or self.max_waiting < 0:
            raise ValueError("max_running must be >= 1 and max_waiting >= 0")
        if self.spec_probe_every < 1:
            raise ValueError(f"spec_probe_every must be >= 1, got {self.spec_probe_every}")
        if self.max_attempts < 1 or self.discovery_s <= 0:
            raise ValueError("max_attempts must be >= 1 and discovery_s > 0")
        if self.verify_timeout_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("verify_timeout_s and prefill_tokens_per_s must be > 0")
        if not self.verify_endpoints:
            raise ValueError("no verify worker: set verify_addr or verify_addrs")

    def prefill_timeout_s(self, prompt_tokens: int) -> float:
        """How long a Prefill of this many prompt tokens (all its items) may take."""
        return self.verify_timeout_s + prompt_tokens / self.prefill_tokens_per_s

    @property
    def verify_endpoints(self) -> tuple[str, ...]:
        return self.verify_addrs or ((self.verify_addr,) if self.verify_addr else ())

    @property
    def draft_endpoints(self) -> tuple[str, ...]:
        return self.draft_addrs or ((self.draft_addr,) if self.draft_addr else ())
