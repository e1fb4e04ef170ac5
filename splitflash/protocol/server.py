"""ROUTER-side loop shared by the services: decode, dispatch, reply; never dies on bad input.

The loop itself answers `Heartbeat` (liveness must not depend on the engine) and refuses a
`Hello` of another protocol version; everything else goes to the service's handler.
A handler may answer with a `Deferred` (work too long for one turn: a long prefill): the
loop then runs one `advance()` of it after each message it serves, or whenever none waits,
round-robin over the deferred calls open, and sends the reply once advance() gives it.
A `QueueClock` keeps when the loop last saw its socket empty, so a handler can tell its caller
how long the message may have waited behind the loop's other work (queueing, which the
gateway would otherwise count as transport).
Failures are reported to `on_error(code)` so each service counts them in its own metrics:
the `ErrorCode` of every Error reply the loop makes, plus "send_failed" (reply to a peer
that is gone or not reading) and "unreadable" (frame without even an identity).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
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
from splitflash.protocol.queue_clock import QueueClock
from splitflash.protocol.sockets import Frames, Incoming, MalformedFrame, parse, router_send

log = logging.getLogger(__name__)

# handler(msg, tensor_frames) -> reply | (reply, reply_tensor_frames) | Deferred
Handler = Callable[[Any, list[zmq.Frame]], Any]
OnError = Callable[[str], None]


class Deferred:
    """A reply made in slices, between other messages. `advance()` does one slice (keep it
    to one bounded unit of work: every other peer waits for it) and returns the reply
    (or (reply, frames)) once done, else None; raising gives the caller an Error reply."""

    def advance(self) -> Any | None:
        raise NotImplementedError

    def abandon(self) -> None:
        """The loop stops before the reply: drop what the work holds (default: nothing)."""


@dataclass(frozen=True, slots=True)
class _Open:
    """A Deferred call and where its reply goes."""

    peer: bytes
    call_id: bytes
    work: Deferred
    name: str  # the request message's type, for logs and errors


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


def _run_handler(inc: Incoming, handler: Handler, on_error: OnError) -> Any:
    msg = inc.msg
    if isinstance(msg, Heartbeat):
        return HeartbeatReply(seq=msg.seq, sent_at=msg.sent_at, replied_at=time.time()), ()
    if isinstance(msg, Hello) and msg.protocol_version != PROTOCOL_VERSION:
        on_error(ErrorCode.PROTOCOL_VERSION)
        return version_error(msg.protocol_version), ()
    return _guarded(lambda: handler(msg, inc.frames), type(msg).__name__,
                    getattr(msg, "request_id", None), on_error)  # fmt: skip


def _guarded(work: Callable[[], Any], name: str, request_id: str | None, on_error: OnError):
    """What work() returns, or the (Error, ()) its exception calls for."""
    try:
        return work()
    except ProtocolError as e:
        on_error(ErrorCode.BAD_REQUEST)
        return Error(code=ErrorCode.BAD_REQUEST, message=str(e), request_id=request_id), ()
    except Exception as e:
        log.exception("handler failed on %s", name)
        on_error(ErrorCode.INTERNAL)
        message = f"{name} failed: {type(e).__name__}: {e}"
        return Error(code=ErrorCode.INTERNAL, message=message, request_id=request_id), ()


def _with_frames(result: Any) -> tuple[Any, Frames]:
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
) -> _Open | None:
    """Decode one received ROUTER message, run it and send the reply (or an Error); a
    Deferred answer comes back to the caller (serve_forever) to advance."""
    try:
        inc = parse(frames, requests, router=True)
    except MalformedFrame as e:
        if e.peer is None:
            on_error("unreadable")
            return None
        _send(sock, e.peer, e.call_id, _refuse_malformed(e, on_error), (), responses, on_error)
        return None
    result = _run_handler(inc, handler, on_error)
    if isinstance(result, Deferred):
        return _Open(inc.peer, inc.call_id, result, type(inc.msg).__name__)
    reply, reply_frames = _with_frames(result)
    _send(sock, inc.peer, inc.call_id, reply, reply_frames, responses, on_error)
    return None


def _receive(sock: zmq.Socket, timeout_ms: int, clock: QueueClock) -> list[zmq.Frame] | None:
    """The next message's frames, or None after timeout_ms without one."""
    if not clock.look(sock):
        if not timeout_ms:
            return None
        came = sock.poll(timeout_ms, zmq.POLLIN)
        clock.empty_at = time.perf_counter()  # empty until now, or it came just now
        if not came:
            return None
    return sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)


def _advance(sock: zmq.Socket, open_calls: deque[_Open], responses: Codec[Any],
             on_error: OnError) -> None:  # fmt: skip
    """One slice of the first open call; its reply once it has one, else it goes last."""
    call = open_calls[0]
    result = _guarded(call.work.advance, call.name, None, on_error)
    if result is None:
        open_calls.rotate(-1)
        return
    open_calls.popleft()
    reply, reply_frames = _with_frames(result)
    _send(sock, call.peer, call.call_id, reply, reply_frames, responses, on_error)


def _abandon(sock: zmq.Socket, open_calls: deque[_Open], responses: Codec[Any],
             on_error: OnError) -> None:  # fmt: skip
    """Stopping: each open call's work dropped, its caller told rather than left to time out."""
    while open_calls:
        call = open_calls.popleft()
        try:
            call.work.abandon()
        except Exception:  # stopping anyway: the other callers still get their answer
            log.exception("abandoning %s failed", call.name)
        stop = Error(code=ErrorCode.INTERNAL, message=f"service stopping: {call.name} not done")
        _send(sock, call.peer, call.call_id, stop, (), responses, on_error)


# Messages that open Deferreds served at most in a row before the next slice.
QUEUED_PER_SLICE = 16


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
    clock: QueueClock | None = None,
) -> None:
    """Serve a ROUTER socket until `stop_event` is set (checked every `poll_ms`).

    `on_idle` runs after every `poll_ms` without a message or open Deferred: background
    work that must not delay a message already waiting (keep each call short). Deferred
    calls advance one slice after each message answered at once, so neither messages nor
    deferred work can starve the other; after a message that opens a Deferred, the next
    ones already waiting are served first (at most QUEUED_PER_SLICE in a row), so Deferreds
    that arrive together are all open at the next slice (the verify server packs Prefills
    open at once into one forward). `clock` (QueueClock) is kept up to date for the handler
    to read. Returns on stop or when the context is terminated; the socket stays the
    caller's.
    """
    report: OnError = on_error or (lambda code: None)
    clock = clock or QueueClock()
    open_calls: deque[_Open] = deque()
    while not stop_event.is_set():
        frames, served = None, 0
        while served < QUEUED_PER_SLICE:
            try:
                frames = _receive(sock, 0 if open_calls or served else poll_ms, clock)
            except zmq.Again:
                frames = None
            except zmq.ZMQError as e:
                if e.errno in (zmq.ETERM, zmq.ENOTSOCK):
                    return
                raise
            if frames is None:
                break
            served += 1
            opened = serve_one(
                sock, frames, handler, requests=requests, responses=responses, on_error=report
            )
            if opened is None:
                break  # answered at once: a slice next, as after any such message
            open_calls.append(opened)
        if not served and not open_calls:
            if on_idle is not None:
                on_idle()
            continue
        if open_calls:
            if frames is not None:  # (else _receive has just seen the socket empty)
                clock.look(sock)  # a message that comes now waits through the slice
            _advance(sock, open_calls, responses, report)
    _abandon(sock, open_calls, responses, report)
