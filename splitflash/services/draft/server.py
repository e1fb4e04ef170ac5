"""The draft service: a ROUTER serving the gateway's Open/Propose/Release and verify's
Features (data plane) on one drafter object.

One thread owns the socket and the drafter, so a Features message and the Propose that
needs it are handled in arrival order. The server keeps each request's committed length
itself and checks every Propose against it before touching the drafter: a desync is a
per-item `Draft.error` and leaves the drafter's state as it was.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq
from prometheus_client import CollectorRegistry, Histogram, start_http_server

from splitflash.models.graphs import graphs_summary
from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    Draft,
    Features,
    FeaturesAck,
    Hello,
    Open,
    OpenReply,
    Propose,
    ProposeItem,
    ProposeReply,
    ProtocolError,
    QueueClock,
    Release,
    ReleaseReply,
    answer_hello,
    decode_tensor,
    serve_forever,
)
from splitflash.protocol.security import open_router, server_curve_from
from splitflash.services.common.metric_math import METRICS, PREFIX, context_bucket
from splitflash.services.common.metrics import draft_metrics, publish_attention_policy
from splitflash.services.draft.batching import propose_all
from splitflash.services.draft.config import DraftSettings
from splitflash.services.draft.drafter_counts import count_drafter_work
from splitflash.services.draft.registry import Drafter, build_drafter, drafter_facts

log = logging.getLogger(__name__)


@dataclass
class _OpenRequest:
    block_size: int
    base_len: int  # committed tokens the drafter has seen (prompt + extends)


def _no_draft(request_id: str, base_len: int, error: str) -> Draft:
    return Draft(request_id=request_id, token_ids=[], base_len=base_len, error=error)


class DraftServer:
    """`drafter` None = build the one named by settings (the CLI path); tests pass one."""

    def __init__(self, settings: DraftSettings, drafter: Drafter | None = None) -> None:
        self.settings = settings
        self.peer_id = settings.peer_id or f"draft-{os.getpid()}"
        self.drafter = drafter if drafter is not None else build_drafter(settings)
        self.facts = drafter_facts(self.drafter)
        self.requests: dict[str, _OpenRequest] = {}
        self.registry = CollectorRegistry()
        self.metrics = draft_metrics(self.registry)
        d = METRICS["step_phase_seconds"]  # only the draft phase is measured here
        self.draft_seconds = Histogram(
            PREFIX + "step_phase_seconds",
            d.doc,
            ["phase"],
            registry=self.registry,
            buckets=d.buckets,
        ).labels(phase="draft")
        self._publish_policy()
        self.stopping = threading.Event()
        self._ctx = zmq.Context()
        try:  # CURVE keys (none = plain TCP); a bad key or a busy port: a clear error
            self._sock, self.endpoint, self._guard = open_router(
                self._ctx,
                settings.bind,
                server_curve_from(settings, "draft"),
                self.metrics.common.count_protocol_error,
                "draft",
            )
        except (RuntimeError, ValueError):
            self._ctx.term()
            raise
        self._http = None
        self.queue = QueueClock()  # replies say how long a message may have queued

    def _publish_policy(self) -> None:
        get_policy = getattr(self.drafter, "attention_policy", None)
        if callable(get_policy):
            in_force, checkpoint, source = get_policy()
            if publish_attention_policy(self.metrics, in_force, checkpoint, source):
                log.warning(
                    "drafter attention policy differs from its checkpoint: %s", self.facts.policy
                )

    # --- lifecycle ------------------------------------------------------------------
    def serve(self) -> None:
        """Serve until `stop()` (or SIGTERM via __main__); closes everything on the way out."""
        try:
            if self.settings.metrics_port:
                self._http, _ = start_http_server(
                    self.settings.metrics_port,
                    addr=self.settings.metrics_host,
                    registry=self.registry,
                )
            log.info(
                "draft %s serving drafter %s on %s; target layers %s; policy: %s",
                self.peer_id,
                self.facts.name,
                self.endpoint,
                list(self.facts.target_layer_ids),
                self.facts.policy or "n/a (no attention)",
            )
            serve_forever(
                self._sock,
                self.handle,
                self.stopping,
                requests=DRAFT_REQUESTS,
                responses=DRAFT_RESPONSES,
                on_error=self.metrics.common.count_protocol_error,
                clock=self.queue,
            )
        finally:
            self.close()

    def stop(self) -> None:
        self.stopping.set()

    def close(self) -> None:
        if self._guard is not None:
            self._guard.stop(self._sock)
        self._sock.close(linger=0)
        self._ctx.term()
        if self._http is not None:
            self._http.shutdown()
            self._http = None

    # --- dispatch -------------------------------------------------------------------
    def handle(self, msg, frames):
        t0, queued = time.perf_counter(), self.queue.waited()
        try:
            match msg:
                case Hello():
                    info = {"drafter": self.facts.name, "policy": self.facts.policy,
                            "cuda_graphs": graphs_summary(getattr(self.drafter, "graphs", None)),
                            "metrics_port": str(self.settings.metrics_port)}  # fmt: skip
                    return answer_hello(
                        msg,
                        service="draft",
                        model=self.facts.name,
                        info=info,
                        target_layer_ids=self.facts.target_layer_ids,
                    )
                case Open():
                    return self._open(msg)
                case Propose():
                    if len(msg.items) > self.settings.max_batch:
                        raise ProtocolError(
                            f"batch of {len(msg.items)} items exceeds "
                            f"max_batch {self.settings.max_batch}"
                        )
                    return self._propose(msg, t0, queued)
                case Features():
                    return self._features(msg, frames)
                case Release():
                    return self._release(msg)
                case _:
                    raise ProtocolError(f"draft does not handle {type(msg).__name__}")
        finally:
            self.metrics.common.service_busy_seconds.inc(time.perf_counter() - t0)

    def _open(self, msg: Open) -> OpenReply:
        rid = msg.request_id
        if time.time() > msg.deadline:
            return OpenReply(request_id=rid, base_len=0, error="deadline: passed before open")
        if rid in self.requests:  # a retried Open starts over rather than mixing two states
            self.drafter.release(rid)
        try:
            self.drafter.open(rid, list(msg.prompt_ids))
        except Exception as e:
            log.warning("open of %s failed: %s", rid, e)
            self.requests.pop(rid, None)
            return OpenReply(request_id=rid, base_len=0, error=f"{type(e).__name__}: {e}")
        self.requests[rid] = _OpenRequest(msg.block_size, len(msg.prompt_ids))
        return OpenReply(request_id=rid, base_len=len(msg.prompt_ids))

    def _propose(self, msg: Propose, t0: float, queued: float) -> ProposeReply:
        now = time.time()
        drafts: dict[int, Draft] = {}
        ready: list[tuple[int, str, int]] = []  # (item index, request id, k)
        for i, item in enumerate(msg.items):
            checked = self._prepare(item, now)
            if isinstance(checked, Draft):
                drafts[i] = checked
            elif checked == 0:
                drafts[i] = Draft(request_id=item.request_id, token_ids=[], base_len=item.base_len)
            else:
                ready.append((i, item.request_id, checked))
        outcomes = propose_all(self.drafter, [(rid, k) for _, rid, k in ready])
        for i, rid, _k in ready:
            base_len, got = self.requests[rid].base_len, outcomes[rid]
            if isinstance(got, Exception):
                log.warning("drafting %s failed: %s", rid, got)
                drafts[i] = _no_draft(rid, base_len, f"{type(got).__name__}: {got}")
            else:
                self.metrics.draft_steps.labels(context_bucket=context_bucket(base_len)).inc()
                drafts[i] = Draft(request_id=rid, token_ids=got, base_len=base_len)
        compute = time.perf_counter() - t0
        self.draft_seconds.observe(compute)
        count_drafter_work(self.drafter, self.metrics, max(item.base_len for item in msg.items))
        ordered = [drafts[i] for i in range(len(msg.items))]
        timings = {"draft": compute, "total": compute, "queued": queued}
        return ProposeReply(drafts=ordered, timings=timings)

    def _prepare(self, item: ProposeItem, now: float) -> Draft | int:
        """Check one item and feed its new tokens to the drafter: k to draft, or a Draft error.

        The committed length is checked here, before extend, so a desync never reaches (or
        corrupts) the drafter's own state.
        """
        rid = item.request_id
        state = self.requests.get(rid)
        if now > item.deadline:
            known = 0 if state is None else state.base_len
            return _no_draft(rid, known, "deadline: passed before drafting")
        if state is None:
            return _no_draft(rid, 0, f"unknown_request: {rid!r} is not open on draft")
        if item.base_len - len(item.last_ids) != state.base_len:
            return _no_draft(
                rid,
                state.base_len,
                (
                    f"desync: draft has {state.base_len} committed tokens of {rid!r}; the gateway "
                    f"sends {len(item.last_ids)} new ones for base_len {item.base_len}"
                ),
            )
        try:
            if item.last_ids:
                self.drafter.extend(rid, list(item.last_ids), item.base_len)
        except Exception as e:
            log.warning("extending %s failed: %s", rid, e)
            return _no_draft(rid, state.base_len, f"{type(e).__name__}: {e}")
        state.base_len = item.base_len
        return max(0, min(item.max_drafts, state.block_size - 1))

    def _features(self, msg: Features, frames) -> FeaturesAck:
        rid = msg.request_id
        if not self.facts.takes_features:
            return FeaturesAck(
                request_id=rid, end_pos=0, error=f"drafter {self.facts.name} takes no features"
            )
        if rid not in self.requests:
            return FeaturesAck(
                request_id=rid, end_pos=0, error=f"unknown_request: {rid!r} is not open on draft"
            )
        if self.facts.target_layer_ids and tuple(msg.layer_ids) != self.facts.target_layer_ids:
            return FeaturesAck(
                request_id=rid,
                end_pos=0,
                error=(
                    f"features of layers {msg.layer_ids}, drafter needs "
                    f"{list(self.facts.target_layer_ids)}"
                ),
            )
        if len(frames) != 1:
            raise ProtocolError(f"Features of {rid!r} carry {len(frames)} tensor frames, not 1")
        feats = decode_tensor(msg, frames[0])  # [n_tokens, len(layer_ids) * hidden]
        try:
            self.drafter.add_features(rid, msg.start_pos, feats)
        except Exception as e:
            log.warning("features of %s refused: %s", rid, e)
            return FeaturesAck(
                request_id=rid, end_pos=msg.start_pos, error=f"{type(e).__name__}: {e}"
            )
        return FeaturesAck(request_id=rid, end_pos=msg.start_pos + msg.n_tokens)

    def _release(self, msg: Release) -> ReleaseReply:
        released = []
        for rid in msg.request_ids:
            if self.requests.pop(rid, None) is not None:
                released.append(rid)
            self.drafter.release(rid)  # drafters' release is idempotent
        return ReleaseReply(released=released)
