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
    ) -> None:
        self.addr = addr
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
        sock = make_socket(self._ctx, "dealer", identity=self._peer_id.encode())
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
