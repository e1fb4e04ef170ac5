"""Continuous batching over N verify and M draft workers.

One loop: admit waiting requests (pin each to a verify and a draft worker, placement.py;
Open on the drafter, then a Prefill on verify in the background), then one step for all
running requests: ONE Propose per draft worker and ONE Verify per verify worker, all
concurrently, then commit. A request joins the running batch when its Prefill answers:
meanwhile the steps go on, and verify runs the prompt a chunk at a time between them
(verify/prefill_job.py), so a long prompt does not stall the other streams. Requests join
and leave between steps. The drafter is optional at every step
(drafting.py). A verify worker lost mid-request: its requests are retried, resumed or
failed with 503 (recovery.py); no verify worker at all: new requests get 503.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from splitflash.protocol import PrefillReply, Release, RemoteError
from splitflash.services.common.metrics import GatewayMetrics
from splitflash.services.gateway.api_errors import ApiError
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.discovery import WorkerPool
from splitflash.services.gateway.drafting import Drafting
from splitflash.services.gateway.jobs import Job
from splitflash.services.gateway.links import WorkerLink
from splitflash.services.gateway.placement import group_by, place
from splitflash.services.gateway.recovery import Recovery, recovery_for
from splitflash.services.gateway.results import commit, fail, finish
from splitflash.services.gateway.spec_gate import ContextGates
from splitflash.services.gateway.step_record import StepTimer, record_gate, record_result
from splitflash.services.gateway.worker_calls import call_prefill, call_verify

log = logging.getLogger("splitflash.gateway.orchestrator")
MAX_PENDING_RELEASES = 4096  # ids kept per down worker until it is back (then released)


class Orchestrator:
    def __init__(
        self,
        settings: GatewaySettings,
        verify: WorkerPool,
        drafting: Drafting,
        metrics: GatewayMetrics,
    ) -> None:
        self.settings = settings
        self.verify = verify
        self.drafting = drafting
        self.metrics = metrics
        self.waiting: deque[Job] = deque()
        self.running: list[Job] = []
        self.prefilling: list[Job] = []  # admitted, their Prefill not answered yet
        self._prefills: set[asyncio.Task] = set()
        self.traces: dict[str, Job] = {}  # most recent requests, for /v1/requests/{id}/trace
        self.releases: dict[WorkerLink, set[str]] = {}  # to release once the worker answers
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.gates = ContextGates(settings.spec_probe_every) if settings.spec_gate else None

    # --- intake ----------------------------------------------------------------------
    def submit(self, job: Job) -> None:
        if not self.verify.alive():
            errors = {link.last_error for link in self.verify.links.values()}
            why = "; ".join(sorted(errors)) or "no verify worker found yet"
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

    @property
    def admitted(self) -> list[Job]:
        """Every request pinned to workers: running, or waiting for its Prefill."""
        return self.running + self.prefilling

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._prefills) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for job in self.admitted + list(self.waiting):
            fail(job, 503, "server shutting down", "shutdown")

    async def _run(self) -> None:
        while True:
            full = len(self.admitted) >= self.settings.max_running
            if not self.running and (not self.waiting or full):  # a Prefill reply wakes it
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
                    fail(job, 500, "internal error in the scheduler", "internal")
                await self._reap()
            self.metrics.running_requests.set(len(self.running))
            self.metrics.prefilling_requests.set(len(self.prefilling))
            self.metrics.waiting_requests.set(len(self.waiting))

    async def _admit(self) -> None:
        room = self.settings.max_running - len(self.admitted)
        batch: list[Job] = []
        while self.waiting and len(batch) < room:
            job = self.waiting.popleft()
            if not job.cancelled:
                batch.append(job)
        if not batch:
            return
        alive = self.verify.alive()
        if not alive:
            for job in batch:
                fail(job, 503, "verify service unavailable", "verify_unavailable")
            return
        place(batch, alive, self.admitted, "verify")
        self.drafting.pin(batch, self.admitted)
        opening = [j for j in batch if j.draft is not None and j.draft.alive]
        await asyncio.gather(*(self.drafting.open(j) for j in opening))
        self.prefilling.extend(batch)
        # One Prefill per request: a worker runs its open Prefills a chunk each in turn, so a
        # short prompt admitted beside a long one starts decoding after its own chunk. (The
        # items of one Prefill run one after the other and share its reply: batched, every
        # request waited for the longest prompt's whole prefill.)
        for job in batch:
            task = asyncio.create_task(self._prefill_on(job), name="prefill")
            self._prefills.add(task)
            task.add_done_callback(self._prefills.discard)

    async def _prefill_on(self, job: Job) -> None:
        """Prefill `job` on its verify worker; then it joins the running batch (if still
        wanted) and the loop wakes."""
        link = job.verify
        try:
            reply = await call_prefill(link, job, self.settings, self.drafting.draft_peer)
            self.prefilling.remove(job)
            if not job.done:  # cancelled while prefilling: _reap released it already
                self.running.append(job)
            self._prefilled(link, job, reply)
        except Exception:  # a bug must not leave the request hanging: fail it
            log.exception("prefill on %s failed", link.addr)
            fail(job, 500, "internal error in the scheduler", "internal")
            self.prefilling = [j for j in self.prefilling if j is not job]
        finally:
            self._wake.set()

    def _prefilled(self, link: WorkerLink, job: Job, reply: PrefillReply | Exception):
        if isinstance(reply, Exception):
            if not job.done:
                self._worker_failed(link, [job], reply)
            return
        (result,) = reply.results
        if result.error:
            status = 400 if "context" in result.error or "prompt" in result.error else 503
            fail(job, status, result.error, "prefill_failed")
        else:
            commit(job, result.committed_ids, result.finished_reason, self.metrics)

    async def _step(self) -> None:
        timer = StepTimer()
        jobs = []
        for job in [j for j in self.running if not j.done]:
            link = job.verify
            if not link.alive or link.generation != job.verify_generation:
                self._lost(job, f"verify worker {link.addr} lost ({link.last_error})")
            else:
                jobs.append(job)
        if not jobs:
            return
        # the longest request's context picks the gate, as it does the step's time bucket
        longest = max(j.base_len for j in jobs)
        bucket, gate = self.gates.for_context(longest) if self.gates else ("", None)
        speculate = gate is None or gate.speculate()
        drafts, fallback = await self.drafting.propose(
            jobs, self.admitted, timer, paused=not speculate
        )
        timer.mark("draft")
        groups = group_by(jobs, lambda j: j.verify)
        replies = await asyncio.gather(
            *(call_verify(link, group, drafts, self.settings) for link, group in groups.items())
        )
        ok = [r for r in replies if not isinstance(r, Exception)]
        timer.mark("verify", max((r.timings.get("total", 0.0) for r in ok), default=0.0),
                   max((r.timings.get("queued", 0.0) for r in ok), default=0.0))  # fmt: skip
        committed: list[int] = []  # commit_len of each request the step served
        for (link, group), reply in zip(groups.items(), replies, strict=True):
            if isinstance(reply, Exception):
                self._worker_failed(link, group, reply)
                continue
            for job, result in zip(group, reply.results, strict=True):
                if result.error:
                    fail(job, 500, f"verify failed: {result.error}", "verify_error")
                    continue
                # Drafts past the budget fill the block's shape and are not judged.
                n_drafted = min(len(drafts.get(job.request_id, [])), max(0, job.remaining - 1))
                reason = fallback.get(job.request_id)
                record_result(job, result, n_drafted, reason, timer, self.metrics)
                commit(job, result.committed_ids, result.finished_reason, self.metrics)
                committed.append(result.commit_len)
        if gate is not None:
            record_gate(gate, bucket, bool(drafts), committed, timer.start, self.metrics)
        timer.finish(self.metrics, longest)

    # --- worker loss -----------------------------------------------------------------
    def _worker_failed(self, link: WorkerLink, jobs: list[Job], exc: Exception) -> None:
        if isinstance(exc, RemoteError):  # the worker answered: it refused this batch
            for job in jobs:
                fail(job, 500, f"verify refused the batch: {exc}", "verify_error")
            return
        link.mark_down(f"{type(exc).__name__}: {exc}")
        for job in jobs:
            self._lost(job, f"verify worker {link.addr} failed: {exc}")

    def _lost(self, job: Job, why: str) -> None:
        """Its verify worker is gone: retry, resume or fail (recovery.py)."""
        if job.done:
            return
        action, reason = recovery_for(job, self.settings)
        if action is Recovery.FAIL or job.cancelled:
            log.warning("%s: %s; failing it: %s", job.request_id, why, reason)
            fail(job, 503, f"{why}; {reason}", "worker_lost")
            return
        log.warning("%s: %s; %s on another worker", job.request_id, why, reason)
        self._release_later(job)
        job.verify = job.draft = None
        job.drafter_generation = -1
        self.running.remove(job)
        self.waiting.appendleft(job)  # first in line: it was admitted before the others

    def _release_later(self, job: Job) -> None:
        for link in (job.verify, job.draft):
            if link is not None:
                ids = self.releases.setdefault(link, set())
                if len(ids) < MAX_PENDING_RELEASES:
                    ids.add(job.request_id)

    async def forget_worker(self, link: WorkerLink) -> None:
        """A worker left for good (dropped from DNS): nothing to release there any more."""
        self.releases.pop(link, None)

    async def _reap(self) -> None:
        """Release finished, failed and cancelled requests on the workers that hold them,
        one Release per worker; and what lost requests left on workers that are back."""
        gone = [j for j in self.running if j.done or j.cancelled]
        self.running = [j for j in self.running if not (j.done or j.cancelled)]
        # A cancelled prompt still prefilling: the Release stops its remaining chunks.
        gone += [j for j in self.prefilling if j.cancelled and not j.done]
        for job in gone:
            if not job.done:
                finish(job, "abort")
            self._release_later(job)
        calls, links = [], []
        for link, ids in list(self.releases.items()):
            if link.alive and ids:
                links.append(link)
                calls.append(link.call(Release(request_ids=sorted(ids)), timeout_s=2.0))
                del self.releases[link]
        results = await asyncio.gather(*calls, return_exceptions=True)
        for link, result in zip(links, results, strict=True):
            if isinstance(result, Exception):
                log.warning("release on %s %s failed: %s", link.service, link.addr, result)
