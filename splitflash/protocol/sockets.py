"""The one place sockets are created, plus the message envelopes (sync and asyncio).

Envelopes (every frame after `payload` is a raw tensor frame, see `tensors.py`):
    ROUTER side: [identity, b"", call_id, payload, *tensor_frames]
    DEALER side:           [b"", call_id, payload, *tensor_frames]
`call_id` is an opaque token (<= 32 bytes) the client picks and the server echoes. It lets
one DEALER carry concurrent calls (a heartbeat while a verify step is in flight) and lets a
client drop a late reply to a call that already timed out, instead of taking it as the
reply to the next call. An empty `call_id` marks a reply that belongs to no call (an Error
for a frame whose envelope could not be read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import zmq
import zmq.asyncio

from splitflash.protocol.codec import Codec
from splitflash.protocol.errors import PeerTimeout, ProtocolError
from splitflash.protocol.security import CurveClient, CurveServer, apply_curve

MAX_CALL_ID_BYTES = 32
Frames = Sequence[Any]  # bytes | memoryview | zmq.Frame, sent as they are


def make_socket(
    ctx: zmq.Context,
    kind: Literal["router", "dealer"],
    *,
    identity: bytes | None = None,
    hwm: int = 1000,
    linger_ms: int = 0,
    rcvtimeo_ms: int | None = None,
    sndtimeo_ms: int | None = None,
    curve: CurveServer | CurveClient | None = None,
) -> zmq.Socket:
    """A ROUTER (services) or DEALER (clients) socket with every option set here.

    Works with a `zmq.asyncio.Context` too (returns an asyncio socket).
    - ROUTER_MANDATORY: a reply to a peer that is gone raises EHOSTUNREACH instead of being
      dropped silently (the server loop counts it).
    - DEALER IMMEDIATE: queue only to connected peers, so a send to a service that is down
      times out (sndtimeo) instead of being delivered, stale, when it comes back.
    - linger 0 by default: on close, undelivered messages are dropped, never block exit.
    - None timeouts mean "block": use the recv helpers' timeouts instead.
    - `curve`: CURVE server keys (a ROUTER; pair with `security.CurveGuard`, which checks
      the client keys) or client keys (a DEALER); None = plain TCP. See `security.py`.
    """
    if kind not in ("router", "dealer"):
        raise ValueError(f"socket kind must be 'router' or 'dealer', not {kind!r}")
    sock = ctx.socket(zmq.ROUTER if kind == "router" else zmq.DEALER)
    try:
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.RCVTIMEO, -1 if rcvtimeo_ms is None else rcvtimeo_ms)
        sock.setsockopt(zmq.SNDTIMEO, -1 if sndtimeo_ms is None else sndtimeo_ms)
        if curve is not None:
            apply_curve(sock, curve)
        if kind == "router":
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        else:
            sock.setsockopt(zmq.IMMEDIATE, 1)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the actual endpoint (resolves `tcp://127.0.0.1:*` to its port)."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def connect(sock: zmq.Socket, endpoint: str) -> None:
    sock.connect(endpoint)


@dataclass(frozen=True, slots=True)
class Incoming:
    """One received message: `peer` is the ROUTER identity (b"" on a DEALER)."""

    peer: bytes
    call_id: bytes
    msg: Any
    frames: list[zmq.Frame]


class MalformedFrame(ProtocolError):
    """A frame that could not be read; carries what is known of its sender for the reply."""

    def __init__(
        self, message: str, *, peer: bytes | None, call_id: bytes, payload: memoryview | None = None
    ) -> None:
        super().__init__(message)
        self.peer = peer  # None: even the identity is missing, no reply is possible
        self.call_id = call_id
        self.payload = payload  # the undecodable payload, if the envelope itself was fine


def parse(frames: list[zmq.Frame], codec: Codec[Any], *, router: bool) -> Incoming:
    """Split an envelope and decode its payload; raises MalformedFrame on any error."""
    peer = frames[0].bytes if router and frames else b""
    rest = frames[1:] if router else frames
    if router and not frames:
        raise MalformedFrame("empty message", peer=None, call_id=b"")
    if len(rest) < 3 or rest[0].bytes != b"":
        raise MalformedFrame(
            f"bad envelope: expected [b'', call_id, payload, *tensors], got {len(rest)} frames",
            peer=peer,
            call_id=b"",
        )
    call_id = rest[1].bytes
    if len(call_id) > MAX_CALL_ID_BYTES:
        raise MalformedFrame(
            f"call_id of {len(call_id)} bytes (max {MAX_CALL_ID_BYTES})", peer=peer, call_id=b""
        )
    payload = rest[2].buffer
    try:
        msg = codec.decode(payload)
    except ProtocolError as e:
        raise MalformedFrame(str(e), peer=peer, call_id=call_id, payload=payload) from e
    return Incoming(peer=peer, call_id=call_id, msg=msg, frames=list(rest[3:]))


def _envelope(peer: bytes | None, call_id: bytes, payload: bytes, frames: Frames) -> list[Any]:
    head = [b"", call_id, payload] if peer is None else [peer, b"", call_id, payload]
    return [*head, *frames]


def _check_timeout(events: int, timeout_ms: int, what: str) -> None:
    if not events:
        raise PeerTimeout(f"no {what} within {timeout_ms} ms")


# ------------------------------------------------------------------ blocking sockets


def router_send(
    sock: zmq.Socket, peer: bytes, call_id: bytes, msg: Any, codec: Codec[Any], frames: Frames = ()
) -> None:
    """Send to one peer without blocking: a server must not stall on one slow client.

    Raises zmq.ZMQError: EHOSTUNREACH if the peer is gone, EAGAIN if its queue is full.
    """
    sock.send_multipart(
        _envelope(peer, call_id, codec.encode(msg), frames), flags=zmq.NOBLOCK, copy=False
    )


def dealer_send(
    sock: zmq.Socket,
    call_id: bytes,
    msg: Any,
    codec: Codec[Any],
    frames: Frames = (),
    *,
    timeout_ms: int,
) -> None:
    """Send within `timeout_ms` (PeerTimeout if no connected peer can take it by then)."""
    payload = codec.encode(msg)
    _check_timeout(sock.poll(timeout_ms, zmq.POLLOUT), timeout_ms, "send slot")
    sock.send_multipart(_envelope(None, call_id, payload, frames), flags=zmq.NOBLOCK, copy=False)


def recv(sock: zmq.Socket, codec: Codec[Any], *, router: bool, timeout_ms: int) -> Incoming:
    """Wait at most `timeout_ms` for one message; PeerTimeout if none, MalformedFrame if bad."""
    _check_timeout(sock.poll(timeout_ms, zmq.POLLIN), timeout_ms, "message")
    # All parts of a multipart message arrive together, so this cannot block after poll.
    frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    return parse(frames, codec, router=router)


# ------------------------------------------------------------------ asyncio sockets (gateway)


async def async_dealer_send(
    sock: zmq.asyncio.Socket,
    call_id: bytes,
    msg: Any,
    codec: Codec[Any],
    frames: Frames = (),
    *,
    timeout_ms: int,
) -> None:
    payload = codec.encode(msg)
    _check_timeout(await sock.poll(timeout_ms, zmq.POLLOUT), timeout_ms, "send slot")
    await sock.send_multipart(
        _envelope(None, call_id, payload, frames), flags=zmq.NOBLOCK, copy=False
    )


async def async_recv(
    sock: zmq.asyncio.Socket, codec: Codec[Any], *, router: bool, timeout_ms: int
) -> Incoming:
    _check_timeout(await sock.poll(timeout_ms, zmq.POLLIN), timeout_ms, "message")
    frames = await sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
    return parse(frames, codec, router=router)
