"""Per-step timing split (draft, verify, queue, transport, schedule) and per-request traces."""

from __future__ import annotations

import logging
import time

from splitflash.services.common.metric_math import GATE_MODES, PHASES, context_bucket
from splitflash.services.common.metrics import GatewayMetrics, record_spec_step
from splitflash.services.common.spec_stats import step_invariants
from splitflash.services.gateway.jobs import Job
from splitflash.services.gateway.spec_gate import SpecGate

log = logging.getLogger("splitflash.gateway.orchestrator")


class StepTimer:
    """Round trips measured here, compute and queueing times reported by the workers.
    queue: what the workers say a message may have waited behind their other work (a prefill
    chunk, a long feature append), within what the round trip leaves after compute;
    transport: the rest (serialisation, sockets); schedule: the gateway's own time. Without
    the queue part a step stalled behind a long prompt's chunk read as slow transport."""

    def __init__(self) -> None:
        self.start = self._last = time.perf_counter()
        self.round_trip: dict[str, float] = {}
        self.worker_time: dict[str, float] = {}
        self.worker_queued: dict[str, float] = {}

    def mark(
        self, phase: str, worker_seconds: float | None = None, queued_seconds: float | None = None
    ) -> None:
        now = time.perf_counter()
        self.round_trip[phase] = now - self._last
        if worker_seconds is not None:
            self.worker_time[phase] = worker_seconds
        if queued_seconds is not None:
            self.worker_queued[phase] = queued_seconds
        self._last = now

    def phases(self) -> dict[str, float]:
        compute = {p: min(self.worker_time.get(p, rt), rt) for p, rt in self.round_trip.items()}
        left = {p: self.round_trip[p] - compute[p] for p in self.round_trip}  # after compute
        queue = {p: min(max(0.0, self.worker_queued.get(p, 0.0)), left[p]) for p in left}
        total = time.perf_counter() - self.start
        schedule = max(0.0, total - sum(self.round_trip.values()))
        return {
            "draft": compute.get("draft", 0.0),
            "verify": compute.get("verify", 0.0),
            "queue": sum(queue.values()),
            "transport": sum(left[p] - queue[p] for p in left),
            "schedule": schedule,
            "total": total,
        }

    def finish(self, metrics: GatewayMetrics, max_context: int) -> None:
        phases = self.phases()
        bucket = context_bucket(max_context)
        metrics.step_seconds.labels(context_bucket=bucket).observe(phases["total"])
        for phase in PHASES:
            metrics.step_phase_seconds.labels(phase=phase).observe(phases[phase])
            metrics.step_phase_by_context_seconds.labels(
                phase=phase, context_bucket=bucket
            ).observe(phases[phase])
        metrics.common.service_busy_seconds.inc(phases["schedule"])


def record_step(job: Job, result, timer: StepTimer, metrics: GatewayMetrics) -> None:
    """The request's own pooled stats and its trace record for this step."""
    phases = timer.phases()
    job.stats.record(
        result.draft_tokens, result.draft_tokens, result.accepted_drafts, result.commit_len
    )
    job.trace.append(
        {
            "context": job.base_len,
            "drafted": result.draft_tokens,
            "accepted_depth": result.accepted_depth,
            "accepted_drafts": result.accepted_drafts,
            "commit_len": result.commit_len,
            "draft_ms": round(phases["draft"] * 1e3, 3),
            "verify_ms": round(phases["verify"] * 1e3, 3),
            "queue_ms": round(phases["queue"] * 1e3, 3),
            "transport_ms": round(phases["transport"] * 1e3, 3),
        }
    )


def record_result(
    job: Job, result, n_drafted: int, reason: str | None, timer: StepTimer, metrics
) -> None:
    """Count one request's verify step: fallback, trace, §4 invariants, spec metrics."""
    if reason:
        metrics.spec.spec_fallback_steps.labels(reason=reason).inc()
    record_step(job, result, timer, metrics)
    finished = bool(result.finished_reason) or result.commit_len >= job.remaining
    broken = step_invariants(
        result.draft_tokens,
        n_drafted,
        result.accepted_drafts,
        result.accepted_depth,
        result.commit_len,
        finished,
    )
    if broken:
        log.error("invariants broken for %s: %s (%s)", job.request_id, broken, result)
    record_spec_step(
        metrics.spec,
        context_bucket(job.base_len),
        result.draft_tokens,
        n_drafted,
        result.accepted_drafts,
        result.commit_len,
        broken,
    )


def record_gate(gate: SpecGate, bucket: str, drafted: bool, committed: list[int], start: float,
                metrics: GatewayMetrics) -> None:  # fmt: skip
    """A step into its context bucket's speculation gate, and the gate's two speeds out to
    splitflash_spec_gate_tokens_per_second. committed: commit_len of each request served."""
    if not committed:
        return
    gate.record(drafted, sum(committed) / len(committed), time.perf_counter() - start)
    gauge = metrics.spec_gate_tokens_per_second
    for mode in GATE_MODES:
        rate = gate.rate(mode)
        if rate is not None:
            gauge.labels(mode=mode, context_bucket=bucket).set(rate)
