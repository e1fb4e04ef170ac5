"""ROUTER-side loop shared by the services: decode, dispatch, reply; never dies on bad input.

The loop itself answers `Heartbeat` (liveness must not depend on the engine) and refuses a
`Hello` of another protocol version; everything else goes to the service's handler.
Failures are reported to `on_error(code)` so each service counts them in its own metrics:
the `ErrorCode` of every Error reply the loop makes, plus "send_failed" (reply to a peer
that is gone or not reading) and "unreadable" (frame without even an identity).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import zmq

from splitflash.protocol.codec import Codec, probe_protocol_version
from splitflash.protocol.errors import ProtocolError
from splitflash.protocol.messages import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
)
from splitflash.protocol.sockets import Frames, Incoming, MalformedFrame, parse, router_send

log = logging.getLogger(__name__)

# handler(msg, tensor_frames) -> reply | (reply, reply_tensor_frames)
Handler = Callable[[Any, list[zmq.Frame]], Any]
OnError = Callable[[str], None]


class StopFlag(Protocol):
    """threading.Event or anything with is_set()."""

    def is_set(self) -> bool: ...


def version_error(remote_version: int | None) -> Error:
    return Error(
        code=ErrorCode.PROTOCOL_VERSION,
        message=f"protocol version mismatch: peer speaks {remote_version}, "
        f"this service speaks {PROTOCOL_VERSION}",
    )


def answer_hello(
    hello: Hello,
    *,
    service: str,
    model: str,
    info: Mapping[str, str] | None = None,
    target_layer_ids: Sequence[int] = (),
) -> HelloReply | Error:
    """Reply to a Hello: HelloReply if its version is ours, else Error naming both versions."""
    if hello.protocol_version != PROTOCOL_VERSION:
        return version_error(hello.protocol_version)
    return HelloReply(
        protocol_version=PROTOCOL_VERSION,
        service=service,
        model=model,
        info=dict(info or {}),
        target_layer_ids=list(target_layer_ids),
    )


def _refuse_malformed(e: MalformedFrame, on_error: OnError) -> Error:
    remote = probe_protocol_version(e.payload) if e.payload is not None else None
    if remote is not None and remote != PROTOCOL_VERSION:
        # A newer/older peer's Hello may not fit our schema; say what is really wrong.
        on_error(ErrorCode.PROTOCOL_VERSION)
        return version_error(remote)
    on_error(ErrorCode.MALFORMED)
    return Error(code=ErrorCode.MALFORMED, message=str(e))


def _run_handler(inc: Incoming, handler: Handler, on_error: OnError) -> tuple[Any, Frames]:
    msg = inc.msg
    if isinstance(msg, Heartbeat):
        return HeartbeatReply(seq=msg.seq, sent_at=msg.sent_at, replied_at=time.time()), ()
    if isinstance(msg, Hello) and msg.protocol_version != PROTOCOL_VERSION:
        on_error(ErrorCode.PROTOCOL_VERSION)
        return version_error(msg.protocol_version), ()
    request_id = getattr(msg, "request_id", None)
    try:
        result = handler(msg, inc.frames)
    except ProtocolError as e:
        on_error(ErrorCode.BAD_REQUEST)
        return Error(code=ErrorCode.BAD_REQUEST, message=str(e), request_id=request_id), ()
    except Exception as e:
        log.exception("handler failed on %s", type(msg).__name__)
        on_error(ErrorCode.INTERNAL)
        message = f"{type(msg).__name__} failed: {type(e).__name__}: {e}"
        return Error(code=ErrorCode.INTERNAL, message=message, request_id=request_id), ()
    return result if isinstance(result, tuple) else (result, ())


def _send(
    sock: zmq.Socket,
    peer: bytes,
    call_id: bytes,
    reply: Any,
    frames: Frames,
    responses: Codec[Any],
    on_error: OnError,
) -> None:
    try:
        router_send(sock, peer, call_id, reply, responses, frames)
    except ProtocolError as e:
        # The handler returned something this socket may not carry: a bug in the service,
        # but the peer still gets an answer instead of waiting for its timeout.
        log.error("handler reply refused: %s", e)
        on_error(ErrorCode.INTERNAL)
        _send(
            sock,
            peer,
            call_id,
            Error(code=ErrorCode.INTERNAL, message=str(e)),
            (),
            responses,
            on_error,
        )
    except zmq.ZMQError as e:
        log.warning("reply to peer %r dropped: %s", peer, e)
        on_error("send_failed")


def serve_one(
    sock: zmq.Socket,
    frames: list[zmq.Frame],
    handler: Handler,
    *,
    requests: Codec[Any],
    responses: Codec[Any],
    on_error: OnError,
) -> None:
    """Decode one received ROUTER message, run it and send the reply (or an Error)."""
    try:
        inc = parse(frames, requests, router=True)
    except MalformedFrame as e:
        if e.peer is None:
            on_error("unreadable")
            return
        _send(sock, e.peer, e.call_id, _refuse_malformed(e, on_error), (), responses, on_error)
        return
    reply, reply_frames = _run_handler(inc, handler, on_error)
    _send(sock, inc.peer, inc.call_id, reply, reply_frames, responses, on_error)


def serve_forever(
    sock: zmq.Socket,
    handler: Handler,
    stop_event: StopFlag,
    *,
    requests: Codec[Any],
    responses: Codec[Any],
    on_error: OnError | None = None,
    poll_ms: int = 100,
    on_idle: Callable[[], None] | None = None,
) -> None:
    """Serve a ROUTER socket until `stop_event` is set (checked every `poll_ms`).

    `on_idle` runs after every `poll_ms` without a message: background work that must not
    delay a message already waiting (keep each call short). Returns on stop or when the
    context is terminated; the socket stays the caller's.
    """
    report: OnError = on_error or (lambda code: None)
    while not stop_event.is_set():
        try:
            if not sock.poll(poll_ms, zmq.POLLIN):
                if on_idle is not None:
                    on_idle()
                continue
            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            continue
        except zmq.ZMQError as e:
            if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                return
            raise
        serve_one(sock, frames, handler, requests=requests, responses=responses, on_error=report)
