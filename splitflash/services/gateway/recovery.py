"""What happens to a request whose verify worker is lost (pure: the rule, no I/O).

A verify worker holds a request's KV cache, so losing it (killed, restarted, dropped from
DNS, a call that failed or timed out) loses the request's state there. The rule:

1. nothing streamed yet: RETRY from the prompt on another verify worker; the client sees
   nothing but latency.
2. tokens already streamed: RESUME on another worker, prefilling prompt + streamed tokens,
   if `resume_streamed` and the request is greedy (the continuation is exactly what the
   lost worker would have produced) or unseeded sampling (still a sample of the target's
   distribution). A seeded sample would silently stop matching its seed: it FAILS.
3. otherwise, or after `max_attempts` verify workers: FAIL with 503 `worker_lost` (a
   stream gets the OpenAI error event and `[DONE]`; nothing hangs).
"""

from __future__ import annotations

from enum import StrEnum

from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.jobs import Job


class Recovery(StrEnum):
    RETRY = "retry"
    RESUME = "resume"
    FAIL = "fail"


def recovery_for(job: Job, settings: GatewaySettings) -> tuple[Recovery, str]:
    """The action for `job` after losing its verify worker, and why (for logs and errors)."""
    if job.attempts >= settings.max_attempts:
        return Recovery.FAIL, f"lost {job.attempts} verify workers (max_attempts)"
    if not job.generated:
        return Recovery.RETRY, "nothing streamed yet"
    if not settings.resume_streamed:
        return Recovery.FAIL, "tokens already streamed and resume_streamed is off"
    if job.temperature > 0 and job.seed is not None:
        return Recovery.FAIL, "tokens already streamed of a seeded sample"
    return Recovery.RESUME, f"resuming after {len(job.generated)} streamed tokens"
