"""Prometheus metrics of the splitflash services.

Each service builds its own bundle on its own `CollectorRegistry` (no global registry, so
tests and `splitflash up` can run several services in one process without clashes):
`gateway_metrics(registry)`, `draft_metrics(registry)`, `verify_metrics(registry)`.
`metric_math.METRICS` is the one list of every metric: name (without the `splitflash_` prefix;
units in the name), type, meaning, labels. Labels with a known, closed set of values are
created up front so their series exist at 0 (`increase()` in an alert cannot see the first
increment of a series that did not exist before it).

Step-level labels: `context_bucket` comes from `metric_math.context_bucket`; for a batched
step (step_seconds, step_phase*, verify_kv_bytes_read) it is the bucket of the longest
context in the batch, for per-request counters (spec_*, generated_tokens, draft_*) it is
that request's context. Gateway and verify must both use the batch rule, since the alert on
seconds per byte divides one by the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.metrics import MetricWrapperBase

from splitflash.services.common.metric_math import (
    METRICS,
    POLICY_INFO_KEYS,
    PREFIX,
    SERIES_SUFFIXES,
)

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram, "info": Info}


def _make(reg: CollectorRegistry, name: str) -> MetricWrapperBase:
    """Register METRICS[name] on `reg`, with its closed-set label values created at 0."""
    d = METRICS[name]
    names = [label for label, _ in d.labels]
    extra = {"buckets": d.buckets} if d.buckets else {}
    metric = _KINDS[d.kind](PREFIX + name, d.doc, names, registry=reg, **extra)
    combos: list[dict[str, str]] = [{}] if d.labels else []
    for label, values in d.labels:
        combos = [{**c, label: v} for c in combos for v in values] if values else []
    for combo in combos:
        metric.labels(**combo)
    return metric


def _build(cls: type, reg: CollectorRegistry, **given: object) -> object:
    """An instance of bundle `cls` whose fields not `given` are METRICS of the same name."""
    made = {f.name: _make(reg, f.name) for f in fields(cls) if f.name not in given}
    return cls(**made, **given)


@dataclass(frozen=True)
class ServiceMetrics:
    """Metrics every service exports; `service` is "gateway", "draft" or "verify"."""

    service: str
    service_busy_seconds: Counter  # the child {service=<this one>}
    protocol_errors: Counter  # {service,code}
    spec_invariant_violations: Counter  # {invariant}

    def count_protocol_error(self, code: str) -> None:
        self.protocol_errors.labels(service=self.service, code=code).inc()


def service_metrics(reg: CollectorRegistry, service: str) -> ServiceMetrics:
    busy = _make(reg, "service_busy_seconds").labels(service=service)
    return _build(ServiceMetrics, reg, service=service, service_busy_seconds=busy)


@dataclass(frozen=True)
class SpecMetrics:
    """Pooled speculative-decoding counters. Build them in exactly one service, the one
    that sees every step's outcome, or the dashboards' sums double-count."""

    spec_verify_steps: Counter
    spec_draft_tokens: Counter
    spec_accepted_tokens: Counter
    spec_accepted_tokens_per_pos: Counter
    spec_drafted_per_pos: Counter
    spec_commit_len: Histogram
    spec_truncated_steps: Counter
    spec_fallback_steps: Counter
    spec_invariant_violations: Counter  # the ServiceMetrics counter of the same registry


def spec_metrics(reg: CollectorRegistry, invariant_violations: Counter) -> SpecMetrics:
    return _build(SpecMetrics, reg, spec_invariant_violations=invariant_violations)


def record_spec_step(
    spec: SpecMetrics,
    bucket: str,
    draft_tokens: int,
    max_depth: int,
    accepted: int,
    commit_len: int,
    broken: Sequence[str] = (),
) -> None:
    """Count one request's verify step (the arguments of spec_totals.SpecTotals.add).

    bucket = context_bucket(request's context); max_depth = deepest drafted node (chain: K);
    broken = the invariant names the step's check returned.
    """
    spec.spec_verify_steps.labels(context_bucket=bucket).inc()
    spec.spec_draft_tokens.labels(context_bucket=bucket).inc(draft_tokens)
    spec.spec_accepted_tokens.labels(context_bucket=bucket).inc(accepted)
    for i in range(accepted):
        spec.spec_accepted_tokens_per_pos.labels(position=str(i)).inc()
    for i in range(max_depth):
        spec.spec_drafted_per_pos.labels(position=str(i)).inc()
    spec.spec_commit_len.observe(commit_len)
    if commit_len < accepted + 1:
        spec.spec_truncated_steps.inc()
    for name in broken:
        spec.spec_invariant_violations.labels(invariant=name).inc()


@dataclass(frozen=True)
class GatewayMetrics:
    requests: Counter
    request_seconds: Histogram
    ttft_seconds: Histogram
    inter_token_seconds: Histogram
    running_requests: Gauge
    prefilling_requests: Gauge
    waiting_requests: Gauge
    spec_gate_tokens_per_second: Gauge  # {mode, context_bucket}
    generated_tokens: Counter
    step_seconds: Histogram
    step_phase_seconds: Histogram
    step_phase_by_context_seconds: Histogram
    spec: SpecMetrics
    common: ServiceMetrics


def gateway_metrics(reg: CollectorRegistry) -> GatewayMetrics:
    common = service_metrics(reg, "gateway")
    spec = spec_metrics(reg, common.spec_invariant_violations)
    return _build(GatewayMetrics, reg, spec=spec, common=common)


@dataclass(frozen=True)
class DraftMetrics:
    draft_steps: Counter
    draft_kv_keys_read: Counter
    draft_forwards: Counter
    draft_graph_capture_failed: Gauge
    draft_graph_captures: Counter
    draft_graph_capture_seconds: Counter
    draft_graph_evictions: Counter
    draft_attention_policy: Info
    draft_attention_policy_mismatch: Gauge
    draft_sliding_keys_bound: Gauge
    common: ServiceMetrics


def draft_metrics(reg: CollectorRegistry) -> DraftMetrics:
    return _build(DraftMetrics, reg, common=service_metrics(reg, "draft"))


LayerPolicy = tuple[str, int | None]  # (kind "sliding" | "full", window in tokens or None)


def publish_attention_policy(
    m: DraftMetrics,
    in_force: Sequence[LayerPolicy],
    checkpoint: Sequence[LayerPolicy],
    source: str,
) -> bool:
    """Export the per-layer policy in force; returns (and exports) whether it differs."""
    m.draft_attention_policy.clear()  # a reload may have fewer layers: drop stale ones
    for layer, (kind, window) in enumerate(in_force):
        values = (kind, "none" if window is None else str(window), source)
        m.draft_attention_policy.labels(layer=str(layer)).info(
            dict(zip(POLICY_INFO_KEYS, values, strict=True))
        )
    mismatch = list(in_force) != list(checkpoint)
    m.draft_attention_policy_mismatch.set(1 if mismatch else 0)
    m.draft_sliding_keys_bound.set(sum(w or 0 for kind, w in in_force if kind == "sliding"))
    return mismatch


@dataclass(frozen=True)
class VerifyMetrics:
    verify_kv_bytes_read: Counter
    verify_forwards: Counter
    verify_prefill_chunk_seconds: Histogram  # {context_bucket}
    verify_graph_capture_failed: Gauge
    verify_batch_invariant: Gauge
    verify_graph_captures: Counter
    verify_graph_capture_seconds: Counter
    verify_graph_evictions: Counter
    verify_drafts_outside_vocabulary: Counter
    kv_pages_used: Gauge
    kv_pages_total: Gauge
    common: ServiceMetrics


def verify_metrics(reg: CollectorRegistry) -> VerifyMetrics:
    return _build(VerifyMetrics, reg, common=service_metrics(reg, "verify"))


def registry_series_names(registry: CollectorRegistry) -> frozenset[str]:
    """Names of every series `registry` exports, samples or not (suffixes included)."""
    return frozenset(
        family.name + suffix
        for family in registry.collect()
        for suffix in SERIES_SUFFIXES.get(family.type, ("",))
    )
