"""What the metrics mean: the metric catalogue and the context buckets.

Pure data and functions (no prometheus_client). `METRICS` lists every metric the services
export (metrics.py registers them; the dashboard tests check every PromQL name against it).
How the counters pool (the dashboards' math, which the response's
`speculative_decoding_stats` must agree with) is in spec_totals.py.

Terms (DESIGN.md §4), per request and per verify step:
  K = draft_tokens, a = accepted_drafts, d = accepted_depth (root = 0), c = commit_len.
Positions are 0-based: position i is the draft node at depth i + 1 (vLLM's convention).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

# Context-length buckets of step timings; k = 1024 tokens. Upper edges are inclusive.
CONTEXT_BUCKETS: tuple[str, ...] = ("<=2k", "<=8k", "<=32k", "<=128k", ">128k")
_BUCKET_EDGES: tuple[tuple[int, str], ...] = (
    (2 * 1024, "<=2k"),
    (8 * 1024, "<=8k"),
    (32 * 1024, "<=32k"),
    (128 * 1024, "<=128k"),
)

# Invariant label values of splitflash_spec_invariant_violations_total. The per-step names
# are those verify/acceptance.check_invariants returns; the last two are checked elsewhere.
INVARIANTS: tuple[str, ...] = (
    "accepted_range",  # 0 <= a <= deepest drafted node
    "depth_equals_accepted",  # d == a
    "commit_len",  # c == a + 1 (c <= a + 1 when the request finished inside the step)
    "accepted_le_drafted",  # a <= K
    "streamed_equals_committed",  # gateway: tokens streamed == sum(c)
    "kv_length",  # either side's KV length != the committed length in the message
)


PREFIX = "splitflash_"
PHASES: tuple[str, ...] = ("draft", "verify", "queue", "transport", "schedule")
FALLBACK_REASONS: tuple[str, ...] = (
    "drafter_down", "deadline", "disabled", "error", "unprofitable",
)  # fmt: skip
GATE_MODES: tuple[str, ...] = ("speculative", "plain")  # gateway/spec_gate.py
LAYER_KINDS: tuple[str, ...] = ("sliding", "full")
MAX_POSITIONS = 16  # block size up to 16: positions 0..15 pre-created, deeper ones on demand

REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STEP_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)
STEP_BUCKETS += (1.0, 2.5, 5.0, 10.0)
COMMIT_LEN_BUCKETS = tuple(float(n) for n in range(1, 18))  # c is an integer in 1..B+1


Labels = tuple[tuple[str, tuple[str, ...]], ...]  # (label, values created up front)


@dataclass(frozen=True)
class MetricDef:
    kind: str  # counter | gauge | histogram | info
    doc: str
    labels: Labels = ()
    buckets: tuple[float, ...] = ()


_BUCKET = ("context_bucket", CONTEXT_BUCKETS)
_POSITION = ("position", tuple(str(i) for i in range(MAX_POSITIONS)))
_LAZY: tuple[str, ...] = ()  # values not known in advance: children appear on first use


def _d(kind: str, doc: str, *labels: tuple[str, tuple[str, ...]], buckets=()) -> MetricDef:
    return MetricDef(kind, doc, labels, tuple(buckets))


# The metric catalogue: name (without PREFIX; units in the name) -> type, meaning, labels.
# Pure data, so the services (metrics.py) and the dashboard tests read the same list.
METRICS = MappingProxyType(
    {
        # -- every service (ServiceMetrics)
        "service_busy_seconds": _d(
            "counter", "Seconds spent working, not waiting; rate() = busy fraction.",
            ("service", _LAZY),
        ),
        "protocol_errors": _d(
            "counter", "Malformed, unknown or refused frames answered with an Error reply.",
            ("service", _LAZY), ("code", _LAZY),
        ),
        "spec_invariant_violations": _d(
            "counter", "Failed speculative-decoding invariant checks (DESIGN.md §4).",
            ("invariant", INVARIANTS),
        ),
        # -- pooled speculative decoding, one update per request per verify step (SpecMetrics)
        "spec_verify_steps": _d(
            "counter", "Request-steps, plain (fallback) steps included: pooled denominator.",
            _BUCKET,
        ),
        "spec_draft_tokens": _d("counter", "Draft tokens proposed (K), in tokens.", _BUCKET),
        "spec_accepted_tokens": _d("counter", "Draft tokens accepted (a), in tokens.", _BUCKET),
        "spec_accepted_tokens_per_pos": _d(
            "counter", "Steps whose accepted path reached this 0-based position (depth - 1).",
            _POSITION,
        ),
        "spec_drafted_per_pos": _d(
            "counter", "Steps that drafted a node at this 0-based position (per-position "
            "acceptance denominator).", _POSITION,
        ),
        "spec_commit_len": _d(
            "histogram", "Tokens committed per request-step: accepted drafts + 1 bonus.",
            buckets=COMMIT_LEN_BUCKETS,
        ),
        "spec_truncated_steps": _d(
            "counter", "Request-steps cut short (c < a + 1) because the request finished."
        ),
        "spec_fallback_steps": _d(
            "counter", "Request-steps run as plain target decode: drafter down, past its "
            "deadline, disabled (by request or server), failed, or paused by the gateway "
            "because plain steps decoded faster (unprofitable).",
            ("reason", FALLBACK_REASONS),
        ),
        # -- gateway
        "requests": _d(
            "counter", "HTTP requests finished, by endpoint path and status code.",
            ("endpoint", _LAZY), ("status", _LAZY),
        ),
        "request_seconds": _d(
            "histogram", "Request wall time, arrival to last byte, seconds.",
            ("endpoint", _LAZY), buckets=REQUEST_BUCKETS,
        ),
        "ttft_seconds": _d(
            "histogram", "Time to first token from arrival, seconds.", buckets=TOKEN_BUCKETS
        ),
        "inter_token_seconds": _d(
            "histogram", "Gap between consecutive streamed tokens of a request, seconds (a "
            "c-token commit gives c-1 zero gaps and one step gap).", buckets=TOKEN_BUCKETS,
        ),
        "running_requests": _d("gauge", "Requests in the running batch."),
        "prefilling_requests": _d(
            "gauge", "Requests admitted whose prompt verify is still prefilling (between the "
            "running batch's steps, a chunk at a time)."
        ),
        "spec_gate_tokens_per_second": _d(
            "gauge", "The speculation gate's measure of one request's decode speed each way "
            "(mean tokens committed per request / median step seconds, recent steps), per "
            "context bucket of a step's longest request (0: not measured); drafting pauses "
            "where plain is faster.", ("mode", GATE_MODES), _BUCKET,
        ),
        "waiting_requests": _d("gauge", "Requests queued, not yet admitted."),
        "generated_tokens": _d(
            "counter", "Tokens streamed to clients (== sum of commit_len), by request context.",
            _BUCKET,
        ),
        "step_seconds": _d(
            "histogram", "Wall time of one batched decode step, seconds; context_bucket = "
            "longest context in the batch.", _BUCKET, buckets=STEP_BUCKETS,
        ),
        "step_phase_seconds": _d(
            "histogram", "Time of one phase of a decode step, seconds: draft/verify = worker "
            "compute, queue = waited in a worker's queue behind its other work (a prefill "
            "chunk; at most), transport = round trips minus those, schedule = gateway "
            "bookkeeping.",
            ("phase", PHASES), buckets=STEP_BUCKETS,
        ),
        "step_phase_by_context_seconds": _d(
            "histogram", "step_phase_seconds by the batch's longest-context bucket, seconds.",
            ("phase", PHASES), _BUCKET, buckets=STEP_BUCKETS,
        ),
        # -- draft service
        "draft_steps": _d("counter", "Drafts made, one per request per step.", _BUCKET),
        "draft_kv_keys_read": _d(
            "counter", "Context keys the drafter's attention read, summed over the layers of "
            "one kind; per draft = rate(this) / rate(draft_steps_total).",
            ("layer_kind", LAYER_KINDS), _BUCKET,
        ),
        "draft_forwards": _d(
            "counter", "DFlash draft forwards (one per Propose batch) by how they ran: "
            "mode=graph replayed a captured CUDA graph over the draft KV pool, mode=eager "
            "launched each kernel from Python (CPU, requests outside the pool, batches past "
            "the largest graph, graphs off or failed).", ("mode", ("graph", "eager")),
        ),
        "draft_graph_capture_failed": _d(
            "gauge", "1 once a draft CUDA graph capture failed: the drafter then runs every "
            "step eagerly (the error is in the draft log)."
        ),
        "draft_graph_captures": _d(
            "counter", "CUDA graphs the drafter captured while serving (a new batch size, "
            "block length or context bucket). Each stalls its step (warm-up forwards, "
            "autotuning, capture); steady traffic should stop adding them."
        ),
        "draft_graph_capture_seconds": _d(
            "counter", "Seconds draft steps spent capturing CUDA graphs (the stalls counted "
            "by draft_graph_captures)."
        ),
        "draft_graph_evictions": _d(
            "counter", "Draft CUDA graphs dropped from the LRU (graph_max_held) to make room "
            "for a new key; the key captures again when met. Growing under steady traffic: "
            "the LRU is smaller than the keys in use (raise SPLITFLASH_DRAFT_GRAPH_MAX_HELD)."
        ),
        "draft_attention_policy": _d(
            "info", "Attention policy in force per drafter layer: kind (sliding/full), window "
            "(tokens; 'none' when full), source (checkpoint/override).", ("layer", _LAZY),
        ),
        "draft_attention_policy_mismatch": _d(
            "gauge", "1 when the attention policy in force differs from the checkpoint's."
        ),
        "draft_sliding_keys_bound": _d(
            "gauge", "Most context keys one draft may read over all sliding layers (sum of W)."
        ),
        # -- verify service
        "verify_kv_bytes_read": _d(
            "counter", "Bytes of KV cache plus weights read by verify forwards; context_bucket "
            "= longest context in the batch (the step_seconds rule).", _BUCKET,
        ),
        "verify_prefill_chunk_seconds": _d(
            "histogram", "Wall time of one prompt chunk's prefill forward on a verify instance, "
            "seconds: the running requests' steps on it wait this long behind the chunk; "
            "context_bucket = the chunk's last position.", _BUCKET, buckets=STEP_BUCKETS,
        ),
        "verify_forwards": _d(
            "counter", "Verify forwards by how they ran: mode=graph replayed a captured CUDA "
            "graph, mode=eager launched each kernel from Python (CPU, blocks of mixed lengths "
            "without KV room to pad them to one, batches past the largest graph, graphs off "
            "or failed).",
            ("mode", ("graph", "eager")),
        ),
        "verify_graph_capture_failed": _d(
            "gauge", "1 once a CUDA graph capture failed: verify then runs every step eagerly "
            "(the error is in the verify log)."
        ),
        "verify_batch_invariant": _d(
            "gauge", "1 when verify steps run batch-invariant (VerifySettings.batch_invariant "
            "on CUDA): a row's logits are the same bits in any step, so greedy speculative "
            "output equals target-only output in bf16 too, at a cost in speed. 0 = the fast "
            "kernels, where a near tie of the target's top two logits can flip."
        ),
        "verify_graph_captures": _d(
            "counter", "CUDA graphs verify captured while serving (a new padded batch, block "
            "length or KV bucket). Each stalls its step (warm-up forwards, autotuning, "
            "capture); steady traffic should stop adding them."
        ),
        "verify_graph_capture_seconds": _d(
            "counter", "Seconds verify steps spent capturing CUDA graphs (the stalls counted "
            "by verify_graph_captures)."
        ),
        "verify_graph_evictions": _d(
            "counter", "Verify CUDA graphs dropped from the LRU (graph_max_held) to make room "
            "for a new key; the key captures again when met. Growing under steady traffic: "
            "the LRU is smaller than the keys in use (raise SPLITFLASH_VERIFY_GRAPH_MAX_HELD)."
        ),
        "verify_drafts_outside_vocabulary": _d(
            "counter", "Verify steps of a request whose drafts held a token id outside the "
            "target's vocabulary: the drafts from it on were dropped (never accepted, so the "
            "output is unchanged). Any increase: the drafter proposes another tokenizer's ids."
        ),
        "kv_pages_used": _d("gauge", "KV cache pages in use."),
        "kv_pages_total": _d("gauge", "KV cache pages allocated."),
    }
)  # fmt: skip


POLICY_INFO_KEYS = ("kind", "window", "source")  # value labels of the policy Info


# Series a metric type exports (prometheus_client's exposition; counters' family names
# drop "_total"; "_created" is the client's creation timestamp).
SERIES_SUFFIXES: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "info": ("_info",),
        "gauge": ("",),
    }
)


def series_labels() -> dict[str, frozenset[str]]:
    """Every series name the catalogue exports -> its label names ("le" on buckets)."""
    out: dict[str, frozenset[str]] = {}
    for name, d in METRICS.items():
        labels = frozenset(label for label, _ in d.labels)
        if d.kind == "info":  # an Info's value keys are labels of its one series
            labels |= frozenset(POLICY_INFO_KEYS)
        for suffix in SERIES_SUFFIXES[d.kind]:
            out[PREFIX + name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return out


def context_bucket(n_tokens: int) -> str:
    """Bucket label of a context of `n_tokens` tokens (e.g. 2048 -> "<=2k", 2049 -> "<=8k")."""
    if n_tokens < 0:
        raise ValueError(f"context length must be >= 0, got {n_tokens}")
    for edge, label in _BUCKET_EDGES:
        if n_tokens <= edge:
            return label
    return CONTEXT_BUCKETS[-1]
