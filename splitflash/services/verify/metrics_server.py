"""The verify service's metrics: its bundle, the verify phase timer and the HTTP endpoint.

One CollectorRegistry per server object (tests run several servers in one process).
Spec counters (spec_verify_steps ...) are NOT built here: metrics.py says they live in
exactly one service, the gateway, or dashboards double-count. Verify counts what only it
sees: invariant violations of its own checks, KV pages, verify compute time, busy time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Histogram, start_http_server

from splitflash.services.common.metric_math import METRICS, PREFIX, context_bucket
from splitflash.services.common.metrics import VerifyMetrics, verify_metrics

log = logging.getLogger(__name__)


def phase_histogram(reg: CollectorRegistry, phase: str) -> Histogram:
    """step_phase_seconds{phase} (catalogue entry; not in the colleague's bundles), with only
    this service's own phase created: the other phases are measured elsewhere."""
    d = METRICS["step_phase_seconds"]
    hist = Histogram(
        PREFIX + "step_phase_seconds", d.doc, ["phase"], registry=reg, buckets=d.buckets
    )
    return hist.labels(phase=phase)


@dataclass
class VerifyServerMetrics:
    registry: CollectorRegistry
    bundle: VerifyMetrics
    verify_seconds: Histogram  # the {phase="verify"} child

    def count_error(self, code: str) -> None:
        self.bundle.common.count_protocol_error(code)

    def count_violations(self, names: list[str]) -> None:
        for name in names:
            self.bundle.common.spec_invariant_violations.labels(invariant=name).inc()

    def add_busy(self, seconds: float) -> None:
        self.bundle.common.service_busy_seconds.inc(seconds)

    def set_batch_invariant(self, in_force: bool) -> None:
        self.bundle.verify_batch_invariant.set(int(in_force))

    def set_kv(self, used: int, total: int) -> None:
        self.bundle.kv_pages_used.set(used)
        self.bundle.kv_pages_total.set(total)

    def count_forward(self, mode: str, graphs) -> None:
        """One verify forward ("graph" | "eager"); graphs: the engine's VerifyGraphs or None
        (its failure flag and the captures made since the last call)."""
        self.bundle.verify_forwards.labels(mode=mode).inc()
        self.bundle.verify_graph_capture_failed.set(int(graphs is not None and graphs.failed))
        if graphs is not None:
            n, seconds = graphs.pop_capture_stats()
            self.bundle.verify_graph_captures.inc(n)
            self.bundle.verify_graph_capture_seconds.inc(seconds)
            self.bundle.verify_graph_evictions.inc(graphs.pop_evictions())

    def count_drafts_cut(self, engine) -> None:
        """The verify steps whose drafts the engine cut at an id outside the vocabulary
        since the last call (TargetEngine.pop_vocab_cuts)."""
        self.bundle.verify_drafts_outside_vocabulary.inc(engine.pop_vocab_cuts())

    def observe_prefill_chunk(self, end_position: int, seconds: float) -> None:
        bucket = context_bucket(end_position)
        self.bundle.verify_prefill_chunk_seconds.labels(context_bucket=bucket).observe(seconds)

    def add_kv_bytes(self, longest_context: int, n_bytes: int) -> None:
        self.bundle.verify_kv_bytes_read.labels(context_bucket=context_bucket(longest_context)).inc(
            n_bytes
        )


def build_verify_metrics() -> VerifyServerMetrics:
    reg = CollectorRegistry()
    return VerifyServerMetrics(reg, verify_metrics(reg), phase_histogram(reg, "verify"))


def start_metrics_http(registry: CollectorRegistry, host: str, port: int):
    """Serve /metrics on host:port in a daemon thread; returns the server (None if port 0).

    Call `.shutdown()` on the result to stop it.
    """
    if port == 0:
        return None
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, port)
    return server
