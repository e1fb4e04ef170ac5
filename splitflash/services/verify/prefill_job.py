"""A Prefill message served in slices: ONE prompt chunk's forward per `advance()`.

The verify server answers a Prefill with a PrefillJob (a protocol Deferred): serve_forever
runs the other messages that arrive meanwhile (the running requests' Verify steps, their
Release, heartbeats) between its chunks, so admitting a 185k-token prompt delays every
other request's step by one chunk's forward (VerifySettings.prefill_chunk tokens), not by
the whole prefill. Prompts open at once share forwards: a chunk's forward takes along every
other open Prefill whose whole remaining prompt fits in its prefill_chunk tokens (unless a
time budget sized the chunk while requests decode), so N short prompts admitted together
cost one forward, not N. The reply (one StepResult per item, in order) goes once every item has
its outcome. A prompt's feature rows go to its drafter chunk by chunk as they are made (the
last chunk's before the reply, as for a Verify step), so neither the GPU holds a long
prompt's features nor the end of its prefill stalls the loop for one huge transfer.

An item's outcome is an error instead when: its deadline passes (before or between chunks),
its draft peer cannot be reached, the engine refuses it (too long, pool full, duplicate id,
a token outside the vocabulary), its own forward fails, or a Release names it first
(`cancel`). A packed forward that fails fails no one: each of its prompts runs alone from
then on, so one prompt that cannot run (say, out of memory) takes no other down with it.
Whatever way an item ends early, PromptRun frees its pages.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from splitflash.protocol import Deferred, Prefill, PrefillReply, StepResult
from splitflash.services.verify.engine import StepReport
from splitflash.services.verify.prompt_run import PromptRun, advance_together
from splitflash.services.verify.sampling import Sampling
from splitflash.services.verify.steps import error_result

if TYPE_CHECKING:
    from splitflash.services.verify.server import VerifyServer

log = logging.getLogger(__name__)


class PrefillJob(Deferred):
    def __init__(self, server: VerifyServer, msg: Prefill, t0: float) -> None:
        self.server = server
        self.items = msg.items
        self.t0 = t0  # the message's arrival: the reply's "total"
        self.outcomes: list[StepReport | StepResult | None] = [None] * len(msg.items)
        self.forward = 0.0  # seconds in this job's forwards (the reply's "forward")
        self.done = False
        self._next = 0  # index of the next item to start
        self._run: tuple[int, PromptRun] | None = None  # the item whose chunks are running
        self.solo = False  # True once a packed forward with this job failed: no more packing

    # --- Deferred ----------------------------------------------------------------------
    def advance(self) -> PrefillReply | None:
        t = time.perf_counter()
        try:
            return self._advance()
        except BaseException:  # a bug: the caller gets an Error; the running prompt's pages
            self.abandon()  # are freed (items done are released by the gateway after it)
            raise
        finally:
            self.server.metrics.add_busy(time.perf_counter() - t)
            self.server.update_kv_gauges()

    def abandon(self) -> None:
        if self._run is not None:
            self._run[1].abort()
            self._run = None
        self.done = True

    # --- the work ----------------------------------------------------------------------
    def _advance(self) -> PrefillReply | None:
        """Start items until one needs a forward, run one chunk of it; the reply at the end."""
        self._start_next()
        if self._run is not None:
            self._chunk()
            if self._run is not None or self._next < len(self.items):
                return None
        return self._reply()

    def _start_next(self) -> None:
        while self._run is None and self._next < len(self.items):
            i, self._next = self._next, self._next + 1
            if self.outcomes[i] is None:  # a Release may have ended it before its start
                self._start(i)

    def _start(self, i: int) -> None:
        item = self.items[i]
        rid = item.request_id
        if time.time() > item.deadline:
            self.outcomes[i] = error_result(rid, 0, "deadline: passed before prefill")
            return
        link = None if item.draft_peer is None else self.server.links.resolve(item.draft_peer)
        if isinstance(link, str):
            self.outcomes[i] = error_result(rid, 0, link)
            return
        engine = self.server.engine
        s = item.sampling
        room = engine.max_context - len(item.prompt_ids)
        try:
            run = engine.start_prefill(rid, list(item.prompt_ids),
                                       Sampling(s.temperature, s.top_p, s.top_k, s.seed),
                                       self.server.stop_ids, max(room, 1),
                                       stream_features=True)  # fmt: skip
        except Exception as e:  # too long, pool full, duplicate id: this item fails only
            self._failed(i, e)
            return
        if link is not None:
            self.server.feature_peers[rid] = link
        self._run = (i, run)

    def _due_run(self) -> PromptRun | None:
        """The running item's run; None (the item ended) once its deadline has passed."""
        i, run = self._run
        if time.time() > self.items[i].deadline:
            why = f"deadline: passed during prefill ({run.cached} of {len(run.prompt)} tokens)"
            self._end(i, error_result(self.items[i].request_id, 0, why))
            return None
        return run

    def _chunk(self) -> None:
        """One forward: this item's next chunk and, packed with it, every other open
        Prefill's next prompt that fits whole in the forward's prefill_chunk tokens."""
        run = self._due_run()
        if run is None:
            return
        server, sizer, cached = self.server, self.server.chunk_sizer, run.cached
        decoding = bool(server.engine.seqs)
        # Decoding requests wait for this chunk: sized to the time budget, if one is set.
        size = None if sizer is None else sizer.tokens(cached, decoding)
        own = min(size or server.engine.prefill_chunk, run.tokens_left)
        # Partners within the chunk's tokens, and within its time budget when one binds.
        spare = None if sizer is None or not decoding else sizer.spare_seconds([(own, cached)])
        partners = [] if self.solo else _partners(self, server.engine.prefill_chunk - own, spare)
        pack = [(self, size), *partners]
        before = [job._run[1].cached for job, _ in pack]
        t = time.perf_counter()
        try:
            reports = advance_together([(job._run[1], n) for job, n in pack],
                                       abort_on_error=len(pack) == 1)  # fmt: skip
        except Exception as e:  # a forward out of memory, say
            if len(pack) == 1:  # the run freed its pages
                self._forward_failed(e, time.perf_counter() - t)
                return
            log.warning("a prefill forward packing %d prompts failed (%s); each runs alone "
                        "from now on", len(pack), e)  # fmt: skip
            for job, _ in pack:  # whichever prompt made it fail: the runs are intact
                job.solo = True
                job.forward += time.perf_counter() - t
            return
        # advance_together synced the device unless every run ended: the chunks' wall time
        seconds = time.perf_counter() - t
        server.metrics.observe_prefill_chunk(run.cached, seconds)
        if sizer is not None:
            chunks = [(job._run[1].cached - c, c) for (job, _), c in zip(pack, before, strict=True)]
            sizer.observe_pack(chunks, seconds)
        for (job, _), report in zip(pack, reports, strict=True):
            job._chunk_ran(report, seconds)

    def _chunk_ran(self, report: StepReport | None, seconds: float) -> None:
        i, run = self._run
        self.forward += seconds
        if report is not None:
            self._run = None
            self.outcomes[i] = report  # its last chunk's rows go with the reply
        elif run.chunk_rows is not None:  # this chunk's rows to the drafter now
            rows = StepReport(self.items[i].request_id, None, 0, features=run.chunk_rows,
                              feature_start=run.chunk_start)  # fmt: skip
            self.server.send_features([rows])

    def _forward_failed(self, e: Exception, seconds: float) -> None:
        i, _ = self._run
        self.forward += seconds
        self._run = None
        self._failed(i, e)

    def _failed(self, i: int, e: Exception) -> None:
        rid = self.items[i].request_id
        log.warning("prefill of %s failed: %s", rid, e)
        self.outcomes[i] = error_result(rid, 0, f"{type(e).__name__}: {e}")
        self.server.feature_peers.pop(rid, None)

    def _end(self, i: int, outcome: StepResult) -> None:
        """The running item stops here with `outcome`, its pages freed."""
        self._run[1].abort()
        self._run = None
        self.outcomes[i] = outcome
        self.server.feature_peers.pop(self.items[i].request_id, None)

    def cancel(self, request_id: str) -> bool:
        """A Release of one of this job's requests: True if it was not done yet (it ends now
        with an error outcome, its pages freed); False if unknown here or already done."""
        if self.done:
            return False
        for i, item in enumerate(self.items):
            if item.request_id != request_id or self.outcomes[i] is not None:
                continue
            why = "released before its prefill finished"
            if self._run is not None and self._run[0] == i:
                self._end(i, error_result(request_id, 0, why))
            else:
                self.outcomes[i] = error_result(request_id, 0, why)
            return True
        return False

    def _reply(self) -> PrefillReply:
        self.done = True
        reports = [x for x in self.outcomes if isinstance(x, StepReport)]
        self.server.send_features(reports)
        results = [self.server.result(x) if isinstance(x, StepReport) else x
                   for x in self.outcomes]  # fmt: skip
        self.outcomes = []  # a long prompt's feature rows: not held until the next Prefill
        self.server.metrics.verify_seconds.observe(self.forward)
        timings = {"forward": self.forward, "total": time.perf_counter() - self.t0}
        return PrefillReply(results=results, timings=timings)


def _partners(lead: PrefillJob, tokens: int, spare_s: float | None):
    """Other open Prefills (in arrival order) whose whole remaining prompt fits in `tokens`
    more of the lead's forward and, when spare_s is given, whose estimated time fits in
    spare_s more seconds of its budget (ChunkSizer.estimate). Short prompts admitted
    together share one forward, while a long prompt keeps chunks of its own (a part of one
    would read its whole context for a few tokens)."""
    out: list[tuple[PrefillJob, int | None]] = []
    sizer = lead.server.chunk_sizer
    for job in lead.server.open_prefills():
        if tokens < 1 or (spare_s is not None and spare_s <= 0):
            break
        if job is lead or job.solo:
            continue
        job._start_next()
        run = None if job._run is None else job._due_run()
        if run is None or run.tokens_left > tokens:
            continue
        n = run.tokens_left
        if spare_s is not None:
            cost = sizer.estimate([(n, run.cached)])
            if cost > spare_s:
                continue
            spare_s -= cost
        out.append((job, None))
        tokens -= n
    return out
