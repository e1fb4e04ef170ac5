"""Continuous batching over the draft and verify services.

One loop: admit waiting requests (Open on the drafter, Prefill on verify), then one step for
all running requests: ONE Propose to the drafter, ONE Verify to the target, commit. Requests
join and leave between steps. The drafter is optional at every step: down, late or erring,
the step runs without drafts and counts a fallback. Verify down fails requests with 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from splitflash.protocol import (
    Open,
    OpenReply,
    Prefill,
    PrefillItem,
    PrefillReply,
    Propose,
    ProposeItem,
    ProposeReply,
    Release,
    SamplingParams,
    Verify,
    VerifyItem,
    VerifyReply,
)
from splitflash.services.common.metric_math import context_bucket
from splitflash.services.common.metrics import GatewayMetrics, record_spec_step
from splitflash.services.common.spec_stats import step_invariants
from splitflash.services.gateway.api_errors import ApiError
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.jobs import Failed, Finished, Job, Tokens
from splitflash.services.gateway.links import WorkerLink
from splitflash.services.gateway.step_record import StepTimer, record_step

log = logging.getLogger("splitflash.gateway.orchestrator")


class Orchestrator:
    def __init__(
        self,
        settings: GatewaySettings,
        verify: WorkerLink,
        draft: WorkerLink | None,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.verify = verify
        self.draft = draft
        self.metrics = metrics
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.traces: dict[str, Job] = {}  # most recent requests, for /v1/requests/{id}/trace
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # --- intake ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        if not self.verify.alive:
            why = self.verify.last_error or "not connected yet"
            raise ApiError(503, f"verify service unavailable ({why})", None, "verify_unavailable")
        if len(self.waiting) >= self.settings.max_waiting:
            raise ApiError(
                429, f"server busy: {len(self.waiting)} requests waiting", None, "queue_full"
            )
        self.waiting.append(job)
        self.traces[job.request_id] = job
        while len(self.traces) > self.settings.trace_requests:
            self.traces.pop(next(iter(self.traces)))
        self.metrics.waiting_requests.set(len(self.waiting))
        self._wake.set()

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        self._wake.set()

    # --- loop ------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="orchestrator")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for job in list(self.running) + list(self.waiting):
            self._fail(job, 503, "server shutting down", "shutdown")

    async def _run(self) -> None:
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
            try:
                await self._admit()
                await self._reap()
                if self.running:
                    await self._step()
                    await self._reap()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug must not stop serving: fail the step's requests
                log.exception("step failed")
                for job in list(self.running):
                    self._fail(job, 500, "internal error in the scheduler", "internal")
                await self._reap()
            self.metrics.running_requests.set(len(self.running))
            self.metrics.waiting_requests.set(len(self.waiting))

    def _drafting(self, job: Job) -> bool:
        return bool(job.spec_enabled and self.draft is not None and self.draft.alive)

    async def _admit(self) -> None:
        room = self.settings.max_running - len(self.running)
        batch: list[Job] = []
        while self.waiting and len(batch) < room:
            job = self.waiting.popleft()
            if not job.cancelled:
                batch.append(job)
        if not batch:
            return
        if not self.verify.alive:
            for job in batch:
                self._fail(job, 503, "verify service unavailable", "verify_unavailable")
            return
        await asyncio.gather(*(self._open(job) for job in batch if self._drafting(job)))
        deadline = time.time() + self.settings.verify_timeout_s
        items = [
            PrefillItem(
                request_id=j.request_id,
                deadline=deadline,
                prompt_ids=j.prompt_ids,
                sampling=SamplingParams(
                    temperature=j.temperature, top_p=j.top_p, top_k=j.top_k, seed=j.seed
                ),
                draft_peer="draft" if j.drafter_generation >= 0 else None,
            )
            for j in batch
        ]
        self.running.extend(batch)
        try:
            reply, _ = await self.verify.client.call(
                Prefill(items=items),
                timeout_s=self.settings.verify_timeout_s,
                expect=PrefillReply,
            )
        except Exception as exc:
            self.verify.mark_down(str(exc))
            for job in batch:
                self._fail(job, 503, f"verify service failed: {exc}", "verify_unavailable")
            return
        for job, result in zip(batch, reply.results, strict=True):
            if result.error:
                status = 400 if "context" in result.error or "prompt" in result.error else 503
                self._fail(job, status, result.error, "prefill_failed")
            else:
                self._commit(job, result.committed_ids, result.finished_reason)

    async def _open(self, job: Job) -> None:
        """(Re)open the request on the drafter with everything committed so far."""
        tokens = job.prompt_ids + job.generated
        try:
            reply, _ = await self.draft.client.call(
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
            log.info("drafter open failed for %s: %s", job.request_id, exc)
            job.drafter_generation = -1
            return
        if reply.error:
            job.drafter_generation = -1
            return
        job.drafter_generation = self.draft.generation
        job.pending_for_drafter = []

    async def _step(self) -> None:
        timer = StepTimer()
        jobs = [j for j in self.running if not j.done]
        # A restarted drafter lost its state: re-open those requests before proposing.
        stale = [
            j for j in jobs if self._drafting(j) and j.drafter_generation != self.draft.generation
        ]
        if stale:
            await asyncio.gather(*(self._open(j) for j in stale))
        drafts, fallback = await self._propose(jobs, timer)
        timer.mark("draft")
        deadline = time.time() + self.settings.verify_timeout_s
        items = [
            VerifyItem(
                request_id=j.request_id,
                deadline=deadline,
                base_len=j.base_len,
                draft_ids=drafts.get(j.request_id, []),
                max_commit=j.remaining,
            )
            for j in jobs
        ]
        try:
            reply, _ = await self.verify.client.call(
                Verify(items=items),
                timeout_s=self.settings.verify_timeout_s,
                expect=VerifyReply,
            )
        except Exception as exc:
            self.verify.mark_down(str(exc))
            for job in jobs:
                self._fail(job, 503, f"verify service failed: {exc}", "verify_unavailable")
            return
        timer.mark("verify", reply.timings.get("total", 0.0))
        for job, result in zip(jobs, reply.results, strict=True):
            if result.error:
                self._fail(job, 500, f"verify failed: {result.error}", "verify_error")
                continue
            reason = fallback.get(job.request_id)
            if reason:
                self.metrics.spec.spec_fallback_steps.labels(reason=reason).inc()
            record_step(job, result, timer, self.metrics)
            finished = bool(result.finished_reason) or result.commit_len >= job.remaining
            broken = step_invariants(
                result.draft_tokens,
                len(drafts.get(job.request_id, [])),
                result.accepted_drafts,
                result.accepted_depth,
                result.commit_len,
                finished,
            )
            if broken:
                log.error("invariants broken for %s: %s (%s)", job.request_id, broken, result)
            record_spec_step(
                self.metrics.spec,
                context_bucket(job.base_len),
                result.draft_tokens,
                len(drafts.get(job.request_id, [])),
                result.accepted_drafts,
                result.commit_len,
                broken,
            )
            self._commit(job, result.committed_ids, result.finished_reason)
        timer.finish(self.metrics, max(j.base_len for j in jobs))

    async def _propose(self, jobs: list[Job], timer: StepTimer):
        """Drafts per request id, and the fallback reason of each request drafting none."""
        fallback: dict[str, str] = {}
        asking = []
        for job in jobs:
            if not job.spec_enabled:
                fallback[job.request_id] = "disabled"
            elif not self._drafting(job) or job.drafter_generation < 0:
                fallback[job.request_id] = "drafter_down"
            elif job.remaining > 1:
                asking.append(job)
        if not asking:
            return {}, fallback
        items = [
            ProposeItem(
                request_id=j.request_id,
                deadline=time.time() + self.settings.draft_timeout_s,
                base_len=j.base_len,
                last_ids=j.pending_for_drafter,
                max_drafts=min(j.block_size - 1, j.remaining - 1),
            )
            for j in asking
        ]
        try:
            reply, _ = await self.draft.client.call(
                Propose(items=items),
                timeout_s=self.settings.draft_timeout_s,
                expect=ProposeReply,
            )
        except Exception as exc:
            reason = "deadline" if self.draft.alive else "drafter_down"
            if "PeerTimeout" in type(exc).__name__ and self.draft.alive:
                self.draft.mark_down(f"propose timed out: {exc}")
            for job in asking:
                fallback[job.request_id] = reason
                job.drafter_generation = -2  # state unknown: re-open before drafting again
            return {}, fallback
        timer.worker_time["draft"] = reply.timings.get("total", 0.0)
        drafts = {}
        for job, draft in zip(asking, reply.drafts, strict=True):
            if draft.error:
                fallback[job.request_id] = "error"
                job.drafter_generation = -2
                log.info("drafter error for %s: %s", job.request_id, draft.error)
                continue
            job.pending_for_drafter = []
            drafts[job.request_id] = list(draft.token_ids)
        return drafts, fallback

    # --- results ---------------------------------------------------------------------
    def _commit(self, job: Job, ids: list[int], finished_reason: str | None) -> None:
        if job.done:
            return
        ids = ids[: max(0, job.remaining)]
        now = time.monotonic()
        if ids:
            if job.first_token_at is None:
                job.first_token_at = now
                self.metrics.ttft_seconds.observe(now - job.created)
            elif job.last_token_at is not None:
                gap = (now - job.last_token_at) / len(ids)
                for _ in ids:
                    self.metrics.inter_token_seconds.observe(gap)
            job.last_token_at = now
            job.generated.extend(ids)
            job.pending_for_drafter.extend(ids)
            self.metrics.generated_tokens.labels(context_bucket=context_bucket(job.base_len)).inc(
                len(ids)
            )
            job.events.put_nowait(Tokens(list(ids)))
        if finished_reason or job.remaining <= 0:
            self._finish(job, "stop" if finished_reason == "stop" else "length")

    def _finish(self, job: Job, reason: str) -> None:
        if not job.done:
            job.done = True
            job.events.put_nowait(Finished(reason))

    def _fail(self, job: Job, status: int, message: str, code: str) -> None:
        if not job.done:
            job.done = True
            job.events.put_nowait(Failed(status, message, code))

    async def _reap(self) -> None:
        """Release finished, failed and cancelled requests on both services."""
        gone = [j for j in self.running if j.done or j.cancelled]
        if not gone:
            return
        self.running = [j for j in self.running if not (j.done or j.cancelled)]
        for job in gone:
            if not job.done:
                self._finish(job, "abort")
        ids = [j.request_id for j in gone]
        calls = [self.verify.client.call(Release(request_ids=ids), timeout_s=2.0)]
        if self.draft is not None and self.draft.alive:
            calls.append(self.draft.client.call(Release(request_ids=ids), timeout_s=2.0))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.warning("release of %d request(s) failed: %s", len(ids), result)
