"""The verify service: a ROUTER serving the gateway's Prefill/Verify/Release on a TargetEngine.

One thread owns the socket, the engine and the data-plane link. Per message:
- Hello: `wants_target_layers` sets which target layers the engine captures (refused while
  requests are open with other layers: their feature streams would change shape mid-way).
- Prefill: one engine.prefill per item; Verify: ONE batched engine.verify for the batch.
  Per-item failures (deadline, desync, unknown request, prompt too long, KV pool full) are
  `StepResult.error`; the other items and the loop go on.
- After a step, each request opened with a `draft_peer` gets its kept feature rows sent to
  the draft service, and the ack awaited, BEFORE the reply is sent (see draft_link.py).
"""

from __future__ import annotations

import logging
import os
import threading
import time

import torch
import zmq

from splitflash.protocol import (
    VERIFY_REQUESTS,
    VERIFY_RESPONSES,
    Error,
    ErrorCode,
    Hello,
    Prefill,
    PrefillItem,
    PrefillReply,
    ProtocolError,
    Release,
    ReleaseReply,
    StepResult,
    Verify,
    VerifyReply,
    answer_hello,
    bind,
    make_socket,
    serve_forever,
)
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.draft_link import DraftLink
from splitflash.services.verify.engine import DesyncError, StepReport, TargetEngine, VerifyInput
from splitflash.services.verify.metrics_server import build_verify_metrics, start_metrics_http
from splitflash.services.verify.sampling import Sampling

log = logging.getLogger(__name__)


def _error_result(request_id: str, base_len: int, error: str) -> StepResult:
    return StepResult(request_id=request_id, committed_ids=[], commit_len=0, base_len=base_len,
                      error=error)


class VerifyServer:
    """`engine` None = load the model named by settings (the CLI path); tests pass one."""

    def __init__(self, settings: VerifySettings, engine: TargetEngine | None = None,
                 *, model_name: str | None = None, stop_ids: tuple[int, ...] | None = None):
        self.settings = settings
        self.peer_id = settings.peer_id or f"verify-{os.getpid()}"
        if engine is None:
            from splitflash.services.verify.loader import load_engine

            engine = load_engine(settings)
        self.engine = engine
        self.model_name = model_name or settings.target
        cfg = engine.model.cfg
        self.stop_ids = frozenset(cfg.eos_token_ids if stop_ids is None else stop_ids)
        self.metrics = build_verify_metrics()
        self.stopping = threading.Event()
        self._ctx = zmq.Context()
        self._sock = make_socket(self._ctx, "router")
        self.endpoint = bind(self._sock, settings.bind)
        self._link = None
        if settings.draft_addr:
            self._link = DraftLink(
                self._ctx, settings.draft_addr, peer_id=self.peer_id,
                timeout_s=settings.features_timeout_s, retry_s=settings.draft_retry_s,
                chunk_rows=settings.features_chunk_rows, on_failure=self.metrics.count_error,
            )
        self._feature_peers: set[str] = set()  # requests whose features go to the draft link
        self._http = None
        self._weight_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
        self._update_kv_gauges()

    # --- lifecycle ------------------------------------------------------------------
    def describe(self) -> dict[str, str]:
        e = self.engine
        page_tokens = e.cache.num_pages * e.cache.page_size
        return {
            "device": str(e.device),
            "dtype": str(e.model.embed_tokens.weight.dtype).removeprefix("torch."),
            "attention_backend": e.model.backend.name,
            "kv_pool": f"{e.cache.num_pages} pages x {e.cache.page_size} = {page_tokens} tokens",
            "max_context": str(e.max_context),
        }

    def serve(self) -> None:
        """Serve until `stop()` (or SIGTERM via __main__); closes everything on the way out."""
        self._http = start_metrics_http(self.metrics.registry, self.settings.metrics_host,
                                        self.settings.metrics_port)
        info = self.describe()
        log.info("verify %s serving %s on %s: %s", self.peer_id, self.model_name, self.endpoint,
                 ", ".join(f"{k}={v}" for k, v in info.items()))
        try:
            serve_forever(self._sock, self.handle, self.stopping, requests=VERIFY_REQUESTS,
                          responses=VERIFY_RESPONSES, on_error=self.metrics.count_error)
        finally:
            self.close()

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        self._sock.close(linger=0)
        self._ctx.term()
        if self._http is not None:
            self._http.shutdown()
            self._http = None

    # --- dispatch -------------------------------------------------------------------
    def handle(self, msg, frames):
        t0 = time.perf_counter()
        try:
            match msg:
                case Hello():
                    return self._hello(msg)
                case Prefill():
                    self._check_batch(len(msg.items))
                    return self._prefill(msg, t0)
                case Verify():
                    self._check_batch(len(msg.items))
                    return self._verify(msg, t0)
                case Release():
                    return self._release(msg)
                case _:
                    raise ProtocolError(f"verify does not handle {type(msg).__name__}")
        finally:
            self.metrics.add_busy(time.perf_counter() - t0)
            self._update_kv_gauges()

    def _check_batch(self, n: int) -> None:
        if n > self.settings.max_batch:
            raise ProtocolError(f"batch of {n} items exceeds max_batch {self.settings.max_batch}")

    def _hello(self, msg: Hello):
        layers = tuple(msg.wants_target_layers)
        n_layers = self.engine.model.cfg.num_layers
        if any(i >= n_layers for i in layers):
            return Error(code=ErrorCode.BAD_REQUEST,
                         message=f"wants_target_layers {list(layers)}: target has {n_layers}")
        if layers != self.engine.feature_layer_ids:
            if self.engine.seqs:
                return Error(code=ErrorCode.BAD_REQUEST, message=(
                    f"cannot switch feature layers {list(self.engine.feature_layer_ids)} -> "
                    f"{list(layers)} with {len(self.engine.seqs)} requests open"))
            log.info("capturing target layers %s for %s", list(layers), msg.peer_id)
            self.engine.feature_layer_ids = layers
        return answer_hello(msg, service="verify", model=self.model_name, info=self.describe())

    # --- prefill --------------------------------------------------------------------
    def _prefill(self, msg: Prefill, t0: float) -> PrefillReply:
        results, forward = [], 0.0
        for item in msg.items:
            t = time.perf_counter()
            results.append(self._prefill_one(item))
            forward += time.perf_counter() - t
        self.metrics.verify_seconds.observe(forward)
        return PrefillReply(results=results,
                            timings={"forward": forward, "total": time.perf_counter() - t0})

    def _prefill_one(self, item: PrefillItem) -> StepResult:
        rid = item.request_id
        if time.time() > item.deadline:
            return _error_result(rid, 0, "deadline: passed before prefill")
        if item.draft_peer is not None and (self._link is None
                                            or item.draft_peer != self.settings.draft_name):
            configured = self.settings.draft_name if self._link else "none"
            return _error_result(rid, 0, f"unknown draft_peer {item.draft_peer!r} "
                                         f"(configured: {configured})")
        s = item.sampling
        sampling = Sampling(s.temperature, s.top_p, s.top_k, s.seed)
        room = self.engine.max_context - len(item.prompt_ids)
        try:
            report = self.engine.prefill(rid, list(item.prompt_ids), sampling, self.stop_ids,
                                         max(room, 1))
        except Exception as e:  # too long, pool full, duplicate id: this item fails only
            log.warning("prefill of %s failed: %s", rid, e)
            return _error_result(rid, 0, f"{type(e).__name__}: {e}")
        if item.draft_peer is not None:
            self._feature_peers.add(rid)
        self._send_features(report)
        return self._result(report)

    # --- verify ---------------------------------------------------------------------
    def _verify(self, msg: Verify, t0: float) -> VerifyReply:
        results: dict[int, StepResult] = {}
        inputs: list[tuple[int, VerifyInput]] = []
        now = time.time()
        for i, item in enumerate(msg.items):
            error = self._verify_precheck(item, now)
            if error is not None:
                results[i] = _error_result(item.request_id, self._committed(item.request_id),
                                           error)
                continue
            room = self.engine.max_context - item.base_len
            max_commit = min(item.max_commit, room)
            inputs.append((i, VerifyInput(item.request_id, item.base_len, list(item.draft_ids),
                                          max_commit)))
        t = time.perf_counter()
        if inputs:
            for (i, inp), result in zip(inputs, self._run_verify([x for _, x in inputs]),
                                        strict=True):
                results[i] = result
        forward = time.perf_counter() - t
        self.metrics.verify_seconds.observe(forward)
        ordered = [results[i] for i in range(len(msg.items))]
        return VerifyReply(results=ordered,
                           timings={"forward": forward, "total": time.perf_counter() - t0})

    def _committed(self, rid: str) -> int:
        seq = self.engine.seqs.get(rid)
        return 0 if seq is None else len(seq.tokens)

    def _verify_precheck(self, item, now: float) -> str | None:
        """Why this item cannot run, checked before the batch so one bad item fails alone."""
        rid = item.request_id
        if now > item.deadline:
            return "deadline: passed before verify"
        seq = self.engine.seqs.get(rid)
        if seq is None:
            return f"unknown_request: {rid!r} is not open on verify (prefilled? released?)"
        if item.base_len != len(seq.tokens):
            self.metrics.count_violations(["kv_length"])
            return (f"desync: gateway says base_len {item.base_len}, verify has "
                    f"{len(seq.tokens)} committed tokens for {rid!r}")
        if item.base_len >= self.engine.max_context:
            return f"context full: {item.base_len} tokens, max_context {self.engine.max_context}"
        return None

    def _run_verify(self, inputs: list[VerifyInput]) -> list[StepResult]:
        try:
            reports = self.engine.verify(inputs)
        except DesyncError as e:  # the precheck makes this a bug; still a reply, never a crash
            log.error("engine desync after precheck: %s", e)
            return [_error_result(x.request_id, self._committed(x.request_id), f"desync: {e}")
                    for x in inputs]
        longest = max(x.base_len for x in inputs)
        self.metrics.add_kv_bytes(longest, self._bytes_read(inputs))
        out = []
        for report in reports:
            if report.error is None:
                self._send_features(report)
            out.append(self._result(report))
        return out

    def _bytes_read(self, inputs: list[VerifyInput]) -> int:
        """KV bytes the batch's attention read plus the weights read once per forward."""
        kv = self.engine.cache.k  # [L, P, S, H_KV, D]; K and V both read
        per_token = 2 * kv.shape[0] * kv.shape[3] * kv.shape[4] * kv.element_size()
        return sum(x.base_len for x in inputs) * per_token + self._weight_bytes

    def _result(self, report: StepReport) -> StepResult:
        rid = report.request_id
        if report.error is not None or report.outcome is None:
            return _error_result(rid, self._committed(rid), report.error or "no outcome")
        self.metrics.count_violations(report.violations)
        o = report.outcome
        reason = None
        if report.finished:
            reason = "stop" if o.committed and o.committed[-1] in self.stop_ids else "length"
        return StepResult(request_id=rid, committed_ids=list(o.committed),
                          commit_len=o.commit_len, accepted_drafts=o.accepted_drafts,
                          accepted_depth=o.accepted_depth, draft_tokens=o.draft_tokens,
                          base_len=report.committed_len, finished_reason=reason)

    def _send_features(self, report: StepReport) -> None:
        feats: torch.Tensor | None = report.features
        if self._link is None or feats is None or report.request_id not in self._feature_peers:
            return
        self._link.send(report.request_id, report.feature_start, feats,
                        self.engine.feature_layer_ids)

    # --- release --------------------------------------------------------------------
    def _release(self, msg: Release) -> ReleaseReply:
        released = [rid for rid in msg.request_ids if self.engine.release(rid)]
        for rid in msg.request_ids:
            self._feature_peers.discard(rid)
            if self._link is not None:
                self._link.forget(rid)
        return ReleaseReply(released=released)

    def _update_kv_gauges(self) -> None:
        cache = self.engine.cache
        self.metrics.set_kv(cache.used_pages, cache.num_pages)
