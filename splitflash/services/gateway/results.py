"""A request's outcomes, as events to its HTTP handler: tokens, finish, failure.

Each is a no-op on a request that is already done, so a late result (a step that raced a
cancel or a failure) can never emit a second ending.
"""

from __future__ import annotations

import time

from splitflash.services.common.metric_math import context_bucket
from splitflash.services.common.metrics import GatewayMetrics
from splitflash.services.gateway.jobs import Failed, Finished, Job, Tokens


def commit(job: Job, ids: list[int], finished_reason: str | None, metrics: GatewayMetrics) -> None:
    """Stream committed tokens to the request's handler; finish it at its end."""
    if job.done:
        return
    ids = ids[: max(0, job.remaining)]
    now = time.monotonic()
    if ids:
        if job.first_token_at is None:
            job.first_token_at = now
            metrics.ttft_seconds.observe(now - job.created)
        elif job.last_token_at is not None:
            gap = (now - job.last_token_at) / len(ids)
            for _ in ids:
                metrics.inter_token_seconds.observe(gap)
        job.last_token_at = now
        job.generated.extend(ids)
        job.pending_for_drafter.extend(ids)
        metrics.generated_tokens.labels(context_bucket=context_bucket(job.base_len)).inc(len(ids))
        job.events.put_nowait(Tokens(list(ids)))
    if finished_reason or job.remaining <= 0:
        finish(job, "stop" if finished_reason == "stop" else "length")


def finish(job: Job, reason: str) -> None:
    if not job.done:
        job.done = True
        job.events.put_nowait(Finished(reason))


def fail(job: Job, status: int, message: str, code: str) -> None:
    if not job.done:
        job.done = True
        job.events.put_nowait(Failed(status, message, code))
