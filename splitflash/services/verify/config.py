"""Settings of the verify service (env prefix SPLITFLASH_VERIFY_). Data only."""

from __future__ import annotations

from dataclasses import dataclass

ENV_PREFIX = "SPLITFLASH_VERIFY_"
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class VerifySettings:
    bind: str = "tcp://127.0.0.1:5555"  # ROUTER the gateway's DEALER connects to
    metrics_port: int = 9102  # prometheus HTTP port; 0 = no metrics server
    metrics_host: str = "127.0.0.1"  # "0.0.0.0" in containers so prometheus can scrape
    target: str = "smollm2-135m"  # model store name or path (GGUF file / HF directory)
    device: str = "cpu"
    dtype: str = ""  # "" = float32 on cpu, bfloat16 on cuda
    kv_pages: int = 2048  # KV pool size in pages (tokens = kv_pages * page_size)
    page_size: int = 16
    max_batch: int = 64  # most items in one Prefill/Verify; larger batches are refused
    max_context: int = 0  # 0 = the model's max_position_embeddings
    # Prompt tokens per prefill forward: longer prompts run in chunks, each attending to the
    # cached ones, so a prefill's activation memory is bounded by a chunk (engine.py).
    prefill_chunk: int = 8192
    # > 0: while other requests are decoding, each prompt chunk is sized so its forward takes
    # about this many ms (fewer tokens as the prompt's context grows: chunk_sizer.py), which
    # bounds what a running stream waits per step during another prompt's admission; 0 =
    # always prefill_chunk tokens (a chunk at 185k then costs several times one at 8k).
    prefill_chunk_ms: float = 0.0
    # CUDA only: verify/decode steps replay CUDA graphs captured at batch sizes 1, 2, 4, ...
    # up to graph_max_batch (padded up to the next one; blocks padded to one length where the
    # KV pool has room); bigger steps, and mixed lengths without that room, run eagerly.
    cuda_graphs: bool = True
    graph_max_batch: int = 32
    # Graphs kept (least recently used dropped). A key is (padded batch, block length, KV
    # power of two, feature layers), so varied traffic can meet more keys than this; every
    # capture stalls its step ~50 ms: a verify_graph_evictions counter that keeps growing
    # under steady traffic says to raise it. Each graph holds its static logits
    # ([B_pad * Q, vocab]).
    graph_max_held: int = 48
    # CUDA only: before serving, one throwaway request's steps compile the kernels and
    # capture batch-1 graphs (warmup.py), so the first client request does not pay ~1 s.
    warmup: bool = True
    # CUDA: every verify/decode row computed the same way whatever step it is in, so greedy
    # speculative output is target-only output bit for bit in bf16 too (otherwise only up
    # to near ties of the top two logits). Costs speed: bench/RESULTS.md. See TargetModel.
    batch_invariant: bool = False
    # Tensor parallelism on this host: the target split over tp_size ranks (this process is
    # rank 0, the others are spawned; "cuda" puts rank r on cuda:r, "cpu" every rank on the
    # CPU; CUDA graphs off). tp_timeout_s bounds one collective: a dead or stuck rank fails
    # the step instead of hanging it. See tp_engine.py.
    tp_size: int = 1
    tp_timeout_s: float = 60.0
    # Data plane: verify -> draft Features. "" = no link (ngram / speculation off).
    draft_addr: str = "tcp://127.0.0.1:5556"
    draft_name: str = "draft"  # the name PrefillItem.draft_peer must carry to use that link
    features_timeout_s: float = 1.0  # wait for one FeaturesAck; past it the step goes on
    features_chunk_rows: int = 2048  # rows per Features message (long prompts are split)
    draft_retry_s: float = 5.0  # after a failed link, skip sends this long before retrying
    heartbeat_timeout_s: float = 2.0  # Hello round trip when (re)opening the draft link
    peer_id: str = ""  # identity in logs and Hello; "" = verify-<pid>
    # CURVE (protocol/security.py): this service's secret key (Z85, inline or a file); the
    # client public keys let in (the gateway's); the draft server's public key for the data
    # plane. All empty = plain TCP.
    curve_secret_key: str = ""
    curve_secret_key_file: str = ""
    curve_client_keys: str = ""  # comma-separated
    curve_client_keys_file: str = ""  # a file of keys or a directory of *.key certificates
    draft_server_key: str = ""
    draft_server_key_file: str = ""

    def __post_init__(self) -> None:
        if self.dtype not in ("", *DTYPES):
            raise ValueError(f"dtype must be one of {DTYPES} or empty, got {self.dtype!r}")
        for name in (
            "kv_pages",
            "page_size",
            "max_batch",
            "features_chunk_rows",
            "graph_max_batch",
            "graph_max_held",
            "tp_size",
            "prefill_chunk",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_context < 0 or not 0 <= self.metrics_port < 65536:
            raise ValueError("max_context must be >= 0 and metrics_port in 0..65535")
        if self.features_timeout_s <= 0 or self.heartbeat_timeout_s <= 0:
            raise ValueError("features_timeout_s and heartbeat_timeout_s must be > 0")
        if self.batch_invariant and self.tp_size > 1:
            raise ValueError("batch_invariant is not supported with tp_size > 1 (the "
                             "all-reduce's order is NCCL's)")  # fmt: skip
        if not self.prefill_chunk_ms >= 0:
            raise ValueError(
                f"prefill_chunk_ms must be >= 0 (0 = off), got {self.prefill_chunk_ms}"
            )
        if self.tp_timeout_s <= 0:
            raise ValueError(f"tp_timeout_s must be > 0, got {self.tp_timeout_s}")

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype:
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def graph_batch_sizes(self) -> tuple[int, ...]:
        sizes, b = [], 1
        while b < self.graph_max_batch:
            sizes.append(b)
            b *= 2
        return (*sizes, self.graph_max_batch)
