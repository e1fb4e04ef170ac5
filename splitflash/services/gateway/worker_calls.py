"""The gateway's two calls to a verify worker, each answering its reply or the exception it
raised (the orchestrator handles a failure per worker: recovery.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

from splitflash.protocol import Prefill, PrefillReply, Verify, VerifyReply
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.jobs import Job
from splitflash.services.gateway.links import WorkerLink
from splitflash.services.gateway.wire_items import prefill_items, verify_items


async def call_prefill(
    link: WorkerLink, job: Job, settings: GatewaySettings, draft_peer: Callable[[Job], str | None]
) -> PrefillReply | Exception:
    """One request's Prefill, with a deadline for its prompt's length."""
    timeout = settings.prefill_timeout_s(job.base_len)
    job.attempts += 1
    job.verify_generation = link.generation
    items = prefill_items([job], time.time() + timeout, draft_peer)
    try:
        reply, _ = await link.call(Prefill(items=items), timeout_s=timeout, expect=PrefillReply)
    except Exception as exc:  # noqa: BLE001 - handled by the caller
        return exc
    return reply


async def call_verify(
    link: WorkerLink, jobs: list[Job], drafts: dict[str, list[int]], settings: GatewaySettings
) -> VerifyReply | Exception:
    """One step's Verify of the requests pinned to this worker."""
    deadline = time.time() + settings.verify_timeout_s
    items = verify_items(jobs, deadline, drafts)
    try:
        reply, _ = await link.call(
            Verify(items=items), timeout_s=settings.verify_timeout_s, expect=VerifyReply
        )
    except Exception as exc:  # noqa: BLE001 - handled per worker by the caller
        return exc
    return reply
