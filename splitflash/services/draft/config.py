"""Settings of the draft service (env prefix SPLITFLASH_DRAFT_). Data only."""

from __future__ import annotations

from dataclasses import dataclass

ENV_PREFIX = "SPLITFLASH_DRAFT_"
WINDOW_OVERRIDES = ("checkpoint", "off")


@dataclass(frozen=True)
class DraftSettings:
    bind: str = "tcp://127.0.0.1:5556"  # ROUTER: gateway control + verify Features
    metrics_port: int = 9101  # prometheus HTTP port; 0 = no metrics server
    metrics_host: str = "127.0.0.1"  # "0.0.0.0" in containers so prometheus can scrape
    # "ngram" | "dflash" (shipped default checkpoint) | "dflash:PATH" | "none"
    drafter: str = "ngram"
    ngram_min_n: int = 1
    ngram_max_n: int = 4
    device: str = "cpu"
    target: str = "smollm2-135m"  # dflash shares the target's embedding and LM head
    # "checkpoint" = the checkpoint's sliding windows; "off" = force full attention, an
    # explicit experiment that is logged loudly and exported as a policy mismatch.
    window_override: str = "checkpoint"
    max_batch: int = 64  # most items in one Propose; larger batches are refused
    # DFlash on CUDA: requests' draft context in one fixed pool (batched attention) and the
    # draft step replayed from CUDA graphs at batch sizes 1, 2, 4 .. 32 (eager otherwise).
    cuda_graphs: bool = True
    pool_slots: int = 64  # requests held in the pool; more run unpooled and eagerly
    pool_context: int = 0  # rows per full draft layer; 0 = the target's context length
    # Draft graphs kept (least recently used dropped): keys are (padded batch, block length,
    # context power of two); a draft_graph_evictions counter that keeps growing under steady
    # traffic says to raise it.
    graph_max_held: int = 24
    # DFlash on CUDA: before serving, a throwaway request's drafts compile the kernels and
    # capture batch-1 graphs (warmup.py), so the first client request does not pay ~1 s.
    warmup: bool = True
    peer_id: str = ""  # identity in logs; "" = draft-<pid>
    # CURVE (protocol/security.py): this service's secret key (Z85, inline or a file) and
    # the client public keys let in (the gateway's and every verify worker's). Empty = plain.
    curve_secret_key: str = ""
    curve_secret_key_file: str = ""
    curve_client_keys: str = ""  # comma-separated
    curve_client_keys_file: str = ""  # a file of keys or a directory of *.key certificates

    def __post_init__(self) -> None:
        kind = self.drafter.split(":", 1)[0]
        if kind not in ("ngram", "dflash", "none", "garbage") or (
            kind != "dflash" and ":" in self.drafter
        ):
            raise ValueError(
                f"drafter must be 'ngram', 'dflash', 'dflash:PATH' or 'none', got {self.drafter!r}"
            )
        if self.window_override not in WINDOW_OVERRIDES:
            raise ValueError(
                f"window_override must be one of {WINDOW_OVERRIDES}, got {self.window_override!r}"
            )
        if not 1 <= self.ngram_min_n <= self.ngram_max_n:
            raise ValueError("ngram n-gram range must satisfy 1 <= min_n <= max_n")
        if self.pool_slots < 0 or self.pool_context < 0:
            raise ValueError("pool_slots and pool_context must be >= 0 (0 = no pool / default)")
        if self.graph_max_held < 1:
            raise ValueError(f"graph_max_held must be >= 1, got {self.graph_max_held}")
        if self.max_batch < 1 or not 0 <= self.metrics_port < 65536:
            raise ValueError("max_batch must be >= 1 and metrics_port in 0..65535")
