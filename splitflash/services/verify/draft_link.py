"""Verify's data-plane link to the draft service: target features as `Features` frames.

Blocking and owned by the verify server's one thread. A step's Features messages (every
request, every chunk) are sent back to back and then all their FeaturesAcks awaited (short
timeout per wait): one round trip per step and draft peer, not one per request. So when a
Prefill/Verify reply leaves verify, the drafter already holds that step's features (or the
send failed and was counted). A failure never fails the step: the
drafter then lacks features for that request, refuses to draft it, and the gateway falls
back to plain decode steps. A request whose feature stream has a gap is not sent any more
features (the drafter would refuse them: `start_pos` must equal its feature length).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable

import torch
import zmq

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    Client,
    Features,
    FeaturesAck,
    PeerTimeout,
    ProtocolError,
    encode_tensor,
    handshake,
    make_hello,
    make_socket,
)
from splitflash.protocol.security import CurveClient
from splitflash.services.verify.requests import StepReport

log = logging.getLogger(__name__)

# Feature batches up to this size are copied to pinned host memory with one wait for the GPU;
# larger ones (long prefills) go through pageable memory so no GBs stay pinned in the cache.
PINNED_MAX_BYTES = 64 << 20


def host_copies(feats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh host copies of feature rows [n_i, F] (zmq may read them after a send returns,
    so never the caller's buffers): on CUDA every copy is queued and the stream waited for
    once, instead of one synchronous copy per request."""
    first, sizes = feats[0], [f.shape[0] for f in feats]
    nbytes = sum(f.numel() for f in feats) * first.element_size()
    pinned = first.is_cuda and nbytes <= PINNED_MAX_BYTES
    host = torch.empty((sum(sizes), *first.shape[1:]), dtype=first.dtype, pin_memory=pinned)
    parts = list(host.split(sizes))
    for dst, src in zip(parts, feats, strict=True):
        dst.copy_(src, non_blocking=pinned)
    if pinned:
        torch.cuda.current_stream(first.device).synchronize()
    return parts


class DraftLink:
    def __init__(
        self,
        ctx: zmq.Context,
        addr: str,
        *,
        peer_id: str,
        timeout_s: float,
        hello_timeout_s: float,
        retry_s: float,
        chunk_rows: int,
        on_failure: Callable[[str], None],
        curve: CurveClient | None = None,
    ) -> None:
        self.addr = addr
        self._curve = curve
        self._ctx = ctx
        self._peer_id = peer_id
        self._timeout_s = timeout_s
        self._hello_timeout_s = hello_timeout_s
        self._retry_s = retry_s
        self._chunk_rows = chunk_rows
        self._on_failure = on_failure
        self._sock: zmq.Socket | None = None
        self._client: Client | None = None
        self._down_until = 0.0  # monotonic time before which sends are skipped
        self.broken: set[str] = set()  # requests whose feature stream has a gap

    def _connected(self) -> Client | None:
        """The client after a successful Hello, or None while the link is down."""
        if self._client is not None:
            return self._client
        if time.monotonic() < self._down_until:
            return None
        # A unique identity: replicas of verify may share a peer_id (same pid in their
        # containers), and a draft ROUTER ignores a second connection with a known identity.
        identity = f"{self._peer_id}-{uuid.uuid4().hex[:8]}".encode()
        sock = make_socket(self._ctx, "dealer", identity=identity, curve=self._curve)
        sock.connect(self.addr)
        client = Client(sock, DRAFT_REQUESTS, DRAFT_RESPONSES)
        try:
            hello = make_hello("verify", self._peer_id)
            reply = handshake(client, hello, timeout_s=self._hello_timeout_s)
        except (PeerTimeout, ProtocolError) as e:
            sock.close(linger=0)
            self._fail("handshake", f"draft service at {self.addr} did not accept Hello: {e}")
            return None
        log.info(
            "data plane to draft at %s up (drafter wants layers %s)",
            self.addr,
            reply.target_layer_ids,
        )
        self._sock, self._client = sock, client
        return client

    def _fail(self, reason: str, message: str) -> None:
        log.warning("features not delivered (%s): %s", reason, message)
        self._on_failure(f"features_{reason}")
        self._down_until = time.monotonic() + self._retry_s

    def send_many(
        self, batch: list[tuple[str, int, torch.Tensor]], layer_ids: tuple[int, ...]
    ) -> dict[str, bool]:
        """Deliver (request_id, start_pos, rows [n, F]) of several requests in one pipelined
        exchange: every Features message is sent, then every ack awaited (Client.call_many), so
        a step of B requests costs one round trip, not B. Rows on the CPU
        should be a fresh tensor the caller no longer writes (zmq may read them late).
        Returns request_id -> True when all its rows were acked."""
        delivered = {rid: False for rid, _, _ in batch}
        live = [item for item in batch if item[0] not in self.broken]
        client = self._connected() if live else None
        if client is None:
            self.broken.update(rid for rid, _, _ in live)
            return delivered
        calls, owners = [], []  # owners[i]: the request of calls[i]
        for rid, start_pos, feats in live:
            for lo in range(0, max(1, feats.shape[0]), self._chunk_rows):
                calls.append(
                    self._features_call(
                        rid, start_pos + lo, feats[lo : lo + self._chunk_rows], layer_ids
                    )
                )
                owners.append(rid)
        outcomes = client.call_many(calls, timeout_s=self._timeout_s, expect=FeaturesAck)
        failed = {
            rid
            for rid, outcome in zip(owners, outcomes, strict=True)
            if not self._acked(rid, outcome)
        }
        timeouts = [o for o in outcomes if isinstance(o, PeerTimeout)]
        if timeouts:  # the late acks, if any, are dropped by call_id; retried after retry_s
            self._fail("timeout", f"{len(timeouts)} of {len(calls)} Features: {timeouts[0]}")
        self.broken.update(failed)
        for rid, _, _ in live:
            delivered[rid] = rid not in failed
        return delivered

    @staticmethod
    def _features_call(rid: str, start: int, rows: torch.Tensor, layer_ids: tuple[int, ...]):
        """(Features, [raw rows]) of one chunk; a GPU tensor is copied to the host here."""
        header, raw = encode_tensor(rows.detach())
        msg = Features(
            request_id=rid,
            start_pos=start,
            n_tokens=rows.shape[0],
            layer_ids=list(layer_ids),
            dtype=header.dtype,
            shape=header.shape,
        )
        return msg, [raw]

    def _acked(self, rid: str, outcome) -> bool:
        if isinstance(outcome, PeerTimeout):
            return False  # counted once for the batch by send_many
        if isinstance(outcome, ProtocolError):
            self._fail("refused", f"{rid}: {outcome}")
            return False
        ack, _ = outcome
        if ack.error is not None:
            # The drafter refused these rows (unknown request, gap): only this request is hit.
            log.warning("drafter refused features of %s: %s", rid, ack.error)
            self._on_failure("features_refused")
            return False
        return True

    def forget(self, request_id: str) -> None:
        self.broken.discard(request_id)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
        self._sock = self._client = None


class DraftLinks:
    """Verify's data-plane links, by the `PrefillItem.draft_peer` a request names.

    Two forms (DESIGN.md §3, several workers): the configured name (`draft_name`, the link to
    `draft_addr`: one drafter) or a draft endpoint itself (`tcp://10.0.3.7:5556`): the
    gateway pins each request to one draft worker and tells verify which, so features go
    where that request's drafts come from. Endpoint links open on first use and stay (a
    draft worker that comes back at the same address is reused). With CURVE, every link
    presents this verify's keys and trusts only the draft server key: naming an endpoint
    cannot make verify hand features to a process without the draft secret key.
    """

    MAX_LINKS = 64  # distinct draft endpoints; more is a misbehaving gateway, not a fleet

    def __init__(self, ctx: zmq.Context, settings, peer_id: str, curve, on_failure) -> None:
        self._make = lambda addr: DraftLink(
            ctx,
            addr,
            peer_id=peer_id,
            timeout_s=settings.features_timeout_s,
            retry_s=settings.draft_retry_s,
            hello_timeout_s=settings.heartbeat_timeout_s,
            chunk_rows=settings.features_chunk_rows,
            on_failure=on_failure,
            curve=curve,
        )
        self._name = settings.draft_name if settings.draft_addr else None
        self._by_addr: dict[str, DraftLink] = {}
        if settings.draft_addr:
            self._by_addr[settings.draft_addr] = self._make(settings.draft_addr)
            self._configured = self._by_addr[settings.draft_addr]

    def resolve(self, peer: str) -> DraftLink | str:
        """The link for `peer`, or why there is none (the prefill item's error)."""
        if self._name is not None and peer == self._name:
            return self._configured
        if not peer.startswith(("tcp://", "ipc://", "inproc://")):
            return f"unknown draft_peer {peer!r} (configured: {self._name})"
        link = self._by_addr.get(peer)
        if link is None:
            if len(self._by_addr) >= self.MAX_LINKS:
                return f"draft_peer {peer!r}: already {self.MAX_LINKS} draft links open"
            link = self._by_addr[peer] = self._make(peer)
        return link

    def close(self) -> None:
        for link in self._by_addr.values():
            link.close()


def send_step_features(
    peers: dict[str, DraftLink], reports: list[StepReport], layer_ids: tuple[int, ...]
) -> None:
    """Features of a step's reports to the drafters of their requests (peers: request ->
    link): one device->host copy for all of them, then one pipelined exchange per link
    (DraftLink.send_many). Reports without features, errors and unlinked requests: none."""
    sent = [
        (peers[r.request_id], r)
        for r in reports
        if r.error is None and r.features is not None and r.request_id in peers
    ]
    if not sent:
        return
    rows = host_copies([r.features for _, r in sent])
    by_link: dict[DraftLink, list[tuple[str, int, torch.Tensor]]] = {}
    for (link, r), feats in zip(sent, rows, strict=True):
        by_link.setdefault(link, []).append((r.request_id, r.feature_start, feats))
    for link, batch in by_link.items():
        link.send_many(batch, layer_ids)
