"""The verify service: a ROUTER serving the gateway's Prefill/Verify/Release on a TargetEngine.

One thread owns the socket, the engine and the data-plane link. Per message:
- Hello from service "gateway": `wants_target_layers` sets which target layers the engine
  captures (refused while requests are open with other layers: their feature streams would
  change shape mid-way), and queues the warm-up of graphs for those layers, run one step at
  a time while no message waits (warmup.py). Other Hellos (health checks) change nothing.
- Prefill: a PrefillJob (prefill_job.py), its items' prompts run one chunk per turn of the
  loop, between the other messages (short prompts open at once packed into one forward),
  replied to when all are done; Verify: ONE batched
  engine.verify for the batch. Per-item failures (deadline, desync, unknown request, prompt
  too long, KV pool full) are `StepResult.error`; the other items and the loop go on.
- After a step, each request opened with a `draft_peer` gets its kept feature rows sent to
  the draft service, and the ack awaited, BEFORE the reply is sent (see draft_link.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import zmq

from splitflash.protocol import (
    VERIFY_REQUESTS,
    VERIFY_RESPONSES,
    Error,
    ErrorCode,
    Hello,
    Prefill,
    ProtocolError,
    QueueClock,
    Release,
    ReleaseReply,
    StepResult,
    Verify,
    VerifyReply,
    answer_hello,
    serve_forever,
)
from splitflash.protocol.security import client_curve_from, open_router, server_curve_from
from splitflash.services.verify.chunk_sizer import ChunkSizer
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.draft_link import DraftLink, DraftLinks, send_step_features
from splitflash.services.verify.engine import DesyncError, StepReport, TargetEngine, VerifyInput
from splitflash.services.verify.metrics_server import build_verify_metrics, start_metrics_http
from splitflash.services.verify.prefill_job import PrefillJob
from splitflash.services.verify.steps import (
    bytes_read,
    committed_len,
    describe_engine,
    error_result,
    step_result,
    verify_precheck,
)
from splitflash.services.verify.warmup import IdleWarmUp

log = logging.getLogger(__name__)
STOP_LINGER_MS = 200


class VerifyServer:
    """`engine` None = load the model named by settings (the CLI path); tests pass one."""

    def __init__(
        self,
        settings: VerifySettings,
        engine: TargetEngine | None = None,
        *,
        model_name: str | None = None,
        stop_ids: tuple[int, ...] | None = None,
    ):
        self.settings = settings
        self.peer_id = settings.peer_id or f"verify-{os.getpid()}"
        if engine is None:
            from splitflash.services.verify.loader import load_engine

            engine = load_engine(settings)
        self.engine = engine
        self.model_name = model_name or settings.target
        eos = engine.model.cfg.eos_token_ids
        self.stop_ids = frozenset(eos if stop_ids is None else stop_ids)
        self.metrics = build_verify_metrics()
        # In force on CUDA only (the CPU path runs the torch references either way).
        # (a TP engine's RankZeroModel has no such flag: the mode is refused with tp_size > 1)
        invariant = getattr(engine.model, "batch_invariant", False)
        self.metrics.set_batch_invariant(invariant and engine.device.type == "cuda")
        self.stopping = threading.Event()
        self._ctx = zmq.Context()
        try:  # CURVE keys (none = plain TCP); a bad key or a busy port: a clear error
            curve = server_curve_from(settings, "verify")
            self._sock, self.endpoint, self._guard = open_router(
                self._ctx, settings.bind, curve, self.metrics.count_error, "verify"
            )
            link_curve = client_curve_from(settings, "draft", "verify")
        except (RuntimeError, ValueError):
            self._ctx.term()
            self._close_engine()
            raise
        self.links = DraftLinks(
            self._ctx, settings, self.peer_id, link_curve, self.metrics.count_error
        )
        self.feature_peers: dict[str, DraftLink] = {}  # request -> its data-plane link
        self._prefills: list[PrefillJob] = []  # Prefill messages not answered yet (some done)
        ms = settings.prefill_chunk_ms  # the sizer None: every chunk prefill_chunk tokens
        self.chunk_sizer = ChunkSizer(ms / 1e3, engine.prefill_chunk) if ms > 0 else None
        self._idle_warmup: IdleWarmUp | None = None  # for feature layers a Hello asked for
        self._http = None
        self.queue = QueueClock()  # replies say how long a message may have queued
        self._weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        self.update_kv_gauges()

    # --- lifecycle ------------------------------------------------------------------
    def describe(self) -> dict[str, str]:
        return describe_engine(self.engine, self.settings.metrics_port)

    def serve(self) -> None:
        """Serve until `stop()` (or SIGTERM via __main__); closes everything on the way out."""
        try:
            self._http = start_metrics_http(
                self.metrics.registry, self.settings.metrics_host, self.settings.metrics_port
            )
            info = ", ".join(f"{k}={v}" for k, v in self.describe().items())
            log.info(
                "verify %s serving %s on %s: %s", self.peer_id, self.model_name, self.endpoint, info
            )
            serve_forever(
                self._sock,
                self.handle,
                self.stopping,
                requests=VERIFY_REQUESTS,
                responses=VERIFY_RESPONSES,
                on_error=self.metrics.count_error,
                on_idle=self._on_idle,
                clock=self.queue,
            )
        finally:
            self.close()

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        self.links.close()
        if self._guard is not None:
            self._guard.stop(self._sock)
        # Replies made on the way out (an open Prefill told the service stops) get a moment.
        self._sock.close(linger=STOP_LINGER_MS)
        self._ctx.term()
        if self._http is not None:
            self._http.shutdown()
            self._http = None
        self._close_engine()

    def _close_engine(self) -> None:
        # Only a tensor-parallel engine has one: it stops and joins its other ranks.
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # --- dispatch -------------------------------------------------------------------
    def handle(self, msg, frames):
        t0, queued = time.perf_counter(), self.queue.waited()
        try:
            match msg:
                case Hello():
                    return self._hello(msg)
                case Prefill():  # served between other messages, a chunk at a time
                    self._check_batch(len(msg.items))
                    job = PrefillJob(self, msg, t0)
                    self._prefills = [*self.open_prefills(), job]
                    return job
                case Verify():
                    self._check_batch(len(msg.items))
                    return self._verify(msg, t0, queued)
                case Release():
                    return self._release(msg)
                case _:
                    raise ProtocolError(f"verify does not handle {type(msg).__name__}")
        finally:
            self.metrics.add_busy(time.perf_counter() - t0)
            self.update_kv_gauges()

    def _check_batch(self, n: int) -> None:
        if n > (limit := self.settings.max_batch):
            raise ProtocolError(f"batch of {n} items exceeds max_batch {limit}")

    def _hello(self, msg: Hello):
        if msg.service != "gateway":  # health checks, probes: they must not reset the layers
            return answer_hello(msg, service="verify", model=self.model_name, info=self.describe())
        layers = tuple(msg.wants_target_layers)
        n_layers = self.engine.model.cfg.num_layers
        if any(i >= n_layers for i in layers):
            return Error(
                code=ErrorCode.BAD_REQUEST,
                message=f"wants_target_layers {list(layers)}: target has {n_layers}",
            )
        if layers != self.engine.feature_layer_ids:
            # cache.seqs: the open requests and the prompts being prefilled
            if n_open := len(self.engine.cache.seqs):
                return Error(
                    code=ErrorCode.BAD_REQUEST,
                    message=(
                        f"cannot switch feature layers {list(self.engine.feature_layer_ids)} -> "
                        f"{list(layers)} with {n_open} requests open"
                    ),
                )
            log.info("capturing target layers %s for %s", list(layers), msg.peer_id)
            self.engine.feature_layer_ids = layers
            if self.settings.warmup and getattr(self.engine, "graphs", None) is not None:
                self._idle_warmup = IdleWarmUp(self.engine)  # graphs of these layers
        return answer_hello(msg, service="verify", model=self.model_name, info=self.describe())

    def _on_idle(self) -> None:
        """Between messages: one shape of the warm-up for newly asked feature layers."""
        warm = self._idle_warmup
        if warm is None:
            return
        try:
            warm.run_one()
        except Exception:  # serving goes on without it: steps capture graphs on demand
            log.exception("verify warm-up for feature layers %s failed", list(warm.layers))
            warm.pending.clear()
        if warm.done:
            self._idle_warmup = None

    # --- verify ---------------------------------------------------------------------
    def _verify(self, msg: Verify, t0: float, queued: float) -> VerifyReply:
        """ONE engine.verify for every item that passes its checks; "forward" is that call,
        "total" the handling, "queued" at most how long the message waited before it."""
        results: dict[int, StepResult] = {}
        inputs: list[tuple[int, VerifyInput]] = []
        now = time.time()
        for i, item in enumerate(msg.items):
            rid = item.request_id
            error = verify_precheck(self.engine, item, now)
            if error is None:
                max_commit = min(item.max_commit, self.engine.max_context - item.base_len)
                inputs.append(
                    (i, VerifyInput(rid, item.base_len, list(item.draft_ids), max_commit))
                )
                continue
            if error.startswith("desync"):
                self.metrics.count_violations(["kv_length"])
            results[i] = error_result(rid, committed_len(self.engine, rid), error)
        t = time.perf_counter()
        reports = self._run_verify([x for _, x in inputs]) if inputs else []
        forward = time.perf_counter() - t
        self.metrics.verify_seconds.observe(forward)
        self.send_features(reports)
        for (i, _), report in zip(inputs, reports, strict=True):
            results[i] = self.result(report)
        ordered = [results[i] for i in range(len(msg.items))]
        total = time.perf_counter() - t0
        timings = {"forward": forward, "total": total, "queued": queued}
        return VerifyReply(results=ordered, timings=timings)

    def _run_verify(self, inputs: list[VerifyInput]) -> list[StepReport]:
        try:
            reports = self.engine.verify(inputs)
        except DesyncError as e:  # the precheck makes this a bug; still a reply, never a crash
            log.error("engine desync after precheck: %s", e)
            return [StepReport(x.request_id, None, 0, error=f"desync: {e}") for x in inputs]
        if self.engine.last_forward_mode is not None:
            self.metrics.count_forward(self.engine.last_forward_mode, self.engine.graphs)
        self.metrics.count_drafts_cut(self.engine)
        base_lens = [x.base_len for x in inputs]
        kv_bytes = bytes_read(self.engine, base_lens, self._weight_bytes)
        self.metrics.add_kv_bytes(max(base_lens), kv_bytes)
        return reports

    def open_prefills(self) -> list[PrefillJob]:
        """The Prefill messages not answered yet, in arrival order."""
        return [j for j in self._prefills if not j.done]

    def send_features(self, reports: list[StepReport]) -> None:
        """Features of a step's reports to their drafters (draft_link.send_step_features)."""
        send_step_features(self.feature_peers, reports, self.engine.feature_layer_ids)

    # --- release --------------------------------------------------------------------
    def _release(self, msg: Release) -> ReleaseReply:
        # A prompt still prefilling stops first: its chunks must not write to freed pages.
        open_jobs = self.open_prefills()
        stopped = {rid for rid in msg.request_ids if any([j.cancel(rid) for j in open_jobs])}
        released = [rid for rid in msg.request_ids if self.engine.release(rid) or rid in stopped]
        for rid in msg.request_ids:
            link = self.feature_peers.pop(rid, None)
            if link is not None:
                link.forget(rid)
        return ReleaseReply(released=released)

    def update_kv_gauges(self) -> None:
        cache = self.engine.cache
        self.metrics.set_kv(cache.used_pages, cache.num_pages)

    def result(self, report: StepReport) -> StepResult:
        self.metrics.count_violations(report.violations)
        return step_result(self.engine, report, self.stop_ids)
