"""Verify's data-plane link to the draft service: target features as `Features` frames.

Blocking and owned by the verify server's one thread. Each send waits for its FeaturesAck
(short timeout), so when a Prefill/Verify reply leaves verify, the drafter already holds that
step's features (or the send failed and was counted). A failure never fails the step: the
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

log = logging.getLogger(__name__)


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

    def send(
        self, request_id: str, start_pos: int, feats: torch.Tensor, layer_ids: tuple[int, ...]
    ) -> bool:
        """Deliver rows [start_pos, start_pos + len(feats)) of one request; True if acked."""
        if request_id in self.broken:
            return False
        client = self._connected()
        if client is None:
            self.broken.add(request_id)
            return False
        for lo in range(0, max(1, feats.shape[0]), self._chunk_rows):
            rows = feats[lo : lo + self._chunk_rows]
            if not self._send_chunk(client, request_id, start_pos + lo, rows, layer_ids):
                self.broken.add(request_id)
                return False
        return True

    def _send_chunk(
        self,
        client: Client,
        request_id: str,
        start: int,
        rows: torch.Tensor,
        layer_ids: tuple[int, ...],
    ) -> bool:
        # A fresh contiguous copy: zmq may read the frame after send returns (tensors.py).
        header, raw = encode_tensor(rows.detach().to("cpu", copy=True).contiguous())
        msg = Features(
            request_id=request_id,
            start_pos=start,
            n_tokens=rows.shape[0],
            layer_ids=list(layer_ids),
            dtype=header.dtype,
            shape=header.shape,
        )
        try:
            ack, _ = client.call(msg, [raw], timeout_s=self._timeout_s, expect=FeaturesAck)
        except PeerTimeout as e:
            # The late ack, if any, is dropped by call_id; the link is reused after retry_s.
            self._fail("timeout", str(e))
            return False
        except ProtocolError as e:
            self._fail("refused", f"{request_id}: {e}")
            return False
        if ack.error is not None:
            # The drafter refused these rows (unknown request, gap): only this request is hit.
            log.warning("drafter refused features of %s: %s", request_id, ack.error)
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
