"""DEALER-side calls: request/reply matched by call_id, each with a timeout (the Hello
handshake over them: hello.py).

`Client` (blocking; e.g. verify's data-plane link to draft) and `AsyncClient` (asyncio;
the gateway) are not thread-safe, like the zmq sockets they wrap: one owner each.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from splitflash.protocol.codec import Codec
from splitflash.protocol.errors import PeerTimeout, ProtocolError, RemoteError
from splitflash.protocol.messages import Error
from splitflash.protocol.sockets import (
    Frames,
    Incoming,
    MalformedFrame,
    async_dealer_send,
    dealer_send,
    parse,
    recv,
)

log = logging.getLogger(__name__)
Reply = tuple[Any, list[zmq.Frame]]


def _ms(seconds: float) -> int:
    return max(0, int(seconds * 1000))


def _checked(inc: Incoming, expect: type | None) -> Reply:
    """The reply, or RemoteError for an Error when a specific type was expected."""
    if expect is not None and not isinstance(inc.msg, expect):
        if isinstance(inc.msg, Error):
            raise RemoteError(inc.msg.code, inc.msg.message, inc.msg.request_id)
        raise ProtocolError(f"expected {expect.__name__}, got {type(inc.msg).__name__}")
    return inc.msg, inc.frames


class _CallIds:
    """8-byte call ids, unique per client (a late reply can never match a newer call)."""

    def __init__(self) -> None:
        self._next = itertools.count(1)

    def new(self) -> bytes:
        return next(self._next).to_bytes(8, "big")


class Client:
    """Blocking calls over one DEALER. Late replies to timed-out calls are dropped and counted."""

    def __init__(
        self,
        sock: zmq.Socket,
        requests: Codec[Any],
        responses: Codec[Any],
        *,
        on_stale: Callable[[], None] | None = None,
    ) -> None:
        self.sock = sock
        self.requests = requests
        self.responses = responses
        self._on_stale = on_stale
        self._ids = _CallIds()

    def call(
        self, msg: Any, frames: Frames = (), *, timeout_s: float, expect: type | None = None
    ) -> Reply:
        """Send `msg` (+ tensor frames) and return (reply, reply frames) within `timeout_s`.

        With `expect`, an Error reply raises RemoteError and another type ProtocolError.
        A reply this side cannot decode raises MalformedFrame (a ProtocolError).
        """
        (outcome,) = self.call_many([(msg, frames)], timeout_s=timeout_s, expect=expect)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def call_many(
        self,
        calls: Sequence[tuple[Any, Frames]],
        *,
        timeout_s: float,
        expect: type | None = None,
    ) -> list[Reply | PeerTimeout | ProtocolError]:
        """Send every (msg, frames), then gather the replies.

        Pipelined: the batch costs one round trip, not one per call (the peer still answers
        each in the order it reads them). `timeout_s` bounds each wait (a send slot, the
        next reply) and restarts on every reply: a stuck peer fails the batch within
        `timeout_s`, a busy one answering a long batch does not. Entry i is call i's
        (reply, frames) or what it met instead, as `call` would raise it: PeerTimeout,
        RemoteError / ProtocolError / MalformedFrame. Never raises for one call.
        """
        outcomes: list[Reply | PeerTimeout | ProtocolError | None] = [None] * len(calls)
        waiting: dict[bytes, int] = {}  # call_id -> index of a call sent, not yet answered
        wait_ms = _ms(timeout_s)
        for i, (msg, frames) in enumerate(calls):
            call_id = self._ids.new()
            try:
                dealer_send(self.sock, call_id, msg, self.requests, frames, timeout_ms=wait_ms)
            except PeerTimeout as e:  # no peer takes messages: the rest would wait as long
                for j in range(i, len(calls)):
                    outcomes[j] = e
                break
            waiting[call_id] = i
        deadline = time.monotonic() + timeout_s
        while waiting:
            left = deadline - time.monotonic()
            try:
                inc = recv(self.sock, self.responses, router=False, timeout_ms=_ms(left))
            except PeerTimeout:
                for i in waiting.values():
                    name = type(calls[i][0]).__name__
                    outcomes[i] = PeerTimeout(f"no reply to {name} within {timeout_s:.3f} s")
                break
            except MalformedFrame as e:
                i = waiting.pop(e.call_id, None)
                if i is None:
                    self._stale(e.call_id)
                else:
                    outcomes[i] = e
                continue
            i = waiting.pop(inc.call_id, None)
            if i is None:
                self._stale(inc.call_id)
                continue
            deadline = time.monotonic() + timeout_s
            try:
                outcomes[i] = _checked(inc, expect)
            except ProtocolError as e:
                outcomes[i] = e
        return outcomes  # type: ignore[return-value]  # every entry is set above

    def _stale(self, call_id: bytes) -> None:
        log.debug("dropping a reply to call %s, which is no longer waited for", call_id.hex())
        if self._on_stale is not None:
            self._on_stale()


class AsyncClient:
    """asyncio calls over one DEALER; many may be in flight at once (one reader task routes
    each reply to its call by call_id). Close with `aclose()`."""

    def __init__(
        self,
        sock: zmq.asyncio.Socket,
        requests: Codec[Any],
        responses: Codec[Any],
        *,
        on_stale: Callable[[], None] | None = None,
    ) -> None:
        self.sock = sock
        self.requests = requests
        self.responses = responses
        self._on_stale = on_stale
        self._ids = _CallIds()
        self._pending: dict[bytes, asyncio.Future[Incoming]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def call(
        self, msg: Any, frames: Frames = (), *, timeout_s: float, expect: type | None = None
    ) -> Reply:
        """As `Client.call`; cancelling the awaiting task abandons the call cleanly."""
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read_replies(), name="zmq-reply-reader")
        call_id = self._ids.new()
        fut: asyncio.Future[Incoming] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = fut
        try:
            async with asyncio.timeout(timeout_s):
                await async_dealer_send(
                    self.sock, call_id, msg, self.requests, frames, timeout_ms=_ms(timeout_s)
                )
                inc = await fut
        except TimeoutError:
            raise PeerTimeout(
                f"no reply to {type(msg).__name__} within {timeout_s:.3f} s"
            ) from None
        finally:
            self._pending.pop(call_id, None)
        return _checked(inc, expect)

    @property
    def in_flight(self) -> int:
        """Calls sent and still waiting for their reply."""
        return len(self._pending)

    async def _read_replies(self) -> None:
        try:
            while True:
                frames = await self.sock.recv_multipart(copy=False)
                self._route(frames)
        except BaseException as e:
            # Socket closed, client closing or a bug here: nobody will answer the calls still
            # waiting, so fail them now rather than let each run into its timeout.
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ProtocolError(f"reply reader stopped: {e!r}"))
            if not isinstance(e, zmq.ZMQError | asyncio.CancelledError):
                log.exception("reply reader failed")
            if not isinstance(e, zmq.ZMQError):
                raise

    def _route(self, frames: list[zmq.Frame]) -> None:
        try:
            inc = parse(frames, self.responses, router=False)
        except MalformedFrame as e:
            fut = self._pending.get(e.call_id)
            if fut is not None and not fut.done():
                fut.set_exception(e)
            else:
                self._stale(e.call_id)
            return
        fut = self._pending.get(inc.call_id)
        if fut is None or fut.done():
            self._stale(inc.call_id)
        else:
            fut.set_result(inc)

    def _stale(self, call_id: bytes) -> None:
        log.debug("dropping a reply to call %s, which is no longer waited for", call_id.hex())
        if self._on_stale is not None:
            self._on_stale()

    async def aclose(self) -> None:
        """Stop the reader (failing calls still waiting); the socket stays the caller's."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
