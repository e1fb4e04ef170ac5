"""The draft side of a step: open requests on their draft worker, one Propose per worker.

Speculation is never a dependency (DESIGN.md §1): every failure here (no drafter, a drafter
down, late or erring) yields no drafts for the requests it touches, with the fallback
reason counted by the orchestrator, and the step goes on as a plain target decode step.

A drafter that leaves: requests pinned to it move to another alive draft worker when the
drafter needs no target features (ngram: its whole state is the committed tokens, which
the re-Open sends). A feature-conditioned drafter (dflash) gets its features from verify,
wired to one draft worker at prefill, so its requests stay and draft nothing until it is
back (then they are re-opened; missing features make it refuse, which is a fallback too).
"""

from __future__ import annotations

import asyncio
import logging
import time

from splitflash.protocol import Open, OpenReply, PeerTimeout, Propose, ProposeItem, ProposeReply
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.discovery import WorkerPool
from splitflash.services.gateway.jobs import Job
from splitflash.services.gateway.links import WorkerLink, WorkerLost
from splitflash.services.gateway.placement import group_by, least_loaded, loads, place
from splitflash.services.gateway.step_record import StepTimer

log = logging.getLogger("splitflash.gateway.drafting")

STALE = -2  # drafter_generation of a request whose draft state is unknown: re-open first


class Drafting:
    def __init__(self, settings: GatewaySettings, pool: WorkerPool | None) -> None:
        self.settings = settings
        self.pool = pool

    def alive(self) -> list[WorkerLink]:
        return self.pool.alive() if self.pool is not None else []

    def pin(self, batch: list[Job], running: list[Job]) -> None:
        """Pin the batch's drafting requests to the least-loaded alive draft workers."""
        place([j for j in batch if j.spec_enabled], self.alive(), running, "draft")

    def draft_peer(self, job: Job) -> str | None:
        """What verify is told about this request's drafter: its endpoint, when it was
        opened there and takes target features (else nothing to send)."""
        link = job.draft
        ok = link is not None and job.drafter_generation == link.generation
        return link.addr if ok and link.takes_features else None

    async def open(self, job: Job) -> None:
        """(Re)open the request on its draft worker with everything committed so far."""
        link = job.draft
        tokens = job.prompt_ids + job.generated
        try:
            reply, _ = await link.call(
                Open(
                    request_id=job.request_id,
                    deadline=time.time() + 5,
                    prompt_ids=tokens,
                    block_size=job.block_size,
                ),
                timeout_s=self.settings.draft_timeout_s,
                expect=OpenReply,
            )
        except Exception as exc:
            log.info("drafter open failed for %s at %s: %s", job.request_id, link.addr, exc)
            job.drafter_generation = STALE
            return
        if reply.error:
            job.drafter_generation = STALE
            return
        job.drafter_generation = link.generation
        job.pending_for_drafter = []

    def _repin(self, jobs: list[Job], running: list[Job]) -> None:
        """Requests whose drafter is down move to an alive one, when they can (see top)."""
        load = loads(running, "draft")
        for job in jobs:
            link = job.draft
            if link is None or link.alive or link.takes_features:
                continue
            other = least_loaded(self.alive(), load)
            if other is not None:
                load[id(other)] += 1
                job.draft, job.drafter_generation = other, STALE

    async def propose(
        self, jobs: list[Job], running: list[Job], timer: StepTimer, paused: bool = False
    ) -> tuple[dict[str, list[int]], dict[str, str]]:
        """Drafts per request id, and the fallback reason of each request drafting none.
        paused: the speculation gate (spec_gate.py) holds drafting back for this step."""
        self._repin(jobs, running)
        fallback: dict[str, str] = {}
        asking: list[Job] = []
        for job in jobs:
            if not job.spec_enabled:
                fallback[job.request_id] = "disabled"
            elif job.draft is None or not job.draft.alive:
                fallback[job.request_id] = "drafter_down"
            elif job.remaining > 1:
                if paused:
                    fallback[job.request_id] = "unprofitable"
                else:
                    asking.append(job)
        # a restarted or re-pinned drafter lost the state: re-open before proposing
        stale = [j for j in asking if j.drafter_generation != j.draft.generation]
        if stale:
            await asyncio.gather(*(self.open(j) for j in stale))
        for job in [j for j in asking if j.drafter_generation != j.draft.generation]:
            fallback[job.request_id] = "error"
            asking.remove(job)
        groups = group_by(asking, lambda j: j.draft)
        replies = await asyncio.gather(
            *(self._propose_on(link, group) for link, group in groups.items())
        )
        drafts: dict[str, list[int]] = {}
        worker_time = queued = 0.0
        for (link, group), reply in zip(groups.items(), replies, strict=True):
            if isinstance(reply, Exception):
                reason = "deadline" if link.alive else "drafter_down"
                if isinstance(reply, PeerTimeout) and link.alive:
                    link.mark_down(f"propose timed out: {reply}")
                for job in group:
                    fallback[job.request_id] = reason
                    job.drafter_generation = STALE
                continue
            worker_time = max(worker_time, reply.timings.get("total", 0.0))
            queued = max(queued, reply.timings.get("queued", 0.0))
            for job, draft in zip(group, reply.drafts, strict=True):
                if draft.error:
                    fallback[job.request_id] = "error"
                    job.drafter_generation = STALE
                    log.info("drafter error for %s: %s", job.request_id, draft.error)
                    continue
                job.pending_for_drafter = []
                drafts[job.request_id] = list(draft.token_ids)
        if groups:
            timer.worker_time["draft"] = worker_time
            timer.worker_queued["draft"] = queued
        return drafts, fallback

    async def _propose_on(self, link: WorkerLink, jobs: list[Job]) -> ProposeReply | Exception:
        items = [
            ProposeItem(
                request_id=j.request_id,
                deadline=time.time() + self.settings.draft_timeout_s,
                base_len=j.base_len,
                last_ids=j.pending_for_drafter,
                # A full block even where fewer tokens remain: verify cuts the commit to
                # the budget, and blocks of one length keep draft and verify steps on
                # their captured CUDA graphs (a batch of mixed lengths runs eagerly).
                max_drafts=j.block_size - 1,
            )
            for j in jobs
        ]
        try:
            reply, _ = await link.call(
                Propose(items=items), timeout_s=self.settings.draft_timeout_s, expect=ProposeReply
            )
        except (WorkerLost, Exception) as exc:  # noqa: BLE001 - every failure is a fallback
            return exc
        return reply
