"""serve_forever's Deferred replies: work done in slices between other messages.

A handler that answers with a Deferred must not hold the loop: other peers' messages are
answered while it is open, it advances between them, several open calls share the slices,
and whatever way it ends (reply, exception, the loop stopping) its caller gets an answer
matched to its call id.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    Deferred,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    QueueClock,
    Release,
    ReleaseReply,
    bind,
    dealer_send,
    make_socket,
    recv,
    serve_forever,
)
from tests.unit.test_protocol_support import Server, T, start_server, tracking_context

pytestmark = pytest.mark.timeout(60)
MS = int(T * 1000)


class Slices(Deferred):
    """Done after `needs` slices, or once `gate` is set when `needs` is None."""

    def __init__(self, name: str, needs: int | None, gate: threading.Event) -> None:
        self.name, self.needs, self.gate = name, needs, gate
        self.slices = 0
        self.abandoned = False

    def advance(self) -> Any | None:
        self.slices += 1
        if self.name == "boom" and self.slices == 2:
            raise RuntimeError("slice 2 exploded")
        done = self.gate.is_set() if self.needs is None else self.slices >= self.needs
        return ReleaseReply(released=[self.name]) if done else None

    def abandon(self) -> None:
        self.abandoned = True


class SlicedHandler:
    """Release(["name:n"]) opens a Deferred of n slices ("name:gate": until the gate)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.opened: dict[str, Slices] = {}

    def __call__(self, msg: Any, frames: list[zmq.Frame]) -> Any:
        assert isinstance(msg, Release)
        name, _, needs = msg.request_ids[0].partition(":")
        if not needs:
            return ReleaseReply(released=[name])  # answered at once
        work = Slices(name, None if needs == "gate" else int(needs), self.gate)
        self.opened[name] = work
        return work


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    yield from tracking_context()


@pytest.fixture
def handler() -> SlicedHandler:
    return SlicedHandler()


@pytest.fixture
def server(ctx: zmq.Context, handler: SlicedHandler) -> Iterator[Server]:
    yield from start_server(ctx, handler)


def _send(sock: zmq.Socket, call: int, msg: Any) -> None:
    dealer_send(sock, call.to_bytes(8, "big"), msg, DRAFT_REQUESTS, timeout_ms=MS)


def _reply(sock: zmq.Socket) -> tuple[int, Any]:
    inc = recv(sock, DRAFT_RESPONSES, router=False, timeout_ms=MS)
    return int.from_bytes(inc.call_id, "big"), inc.msg


def test_other_peers_are_answered_while_a_deferred_call_is_open(server, handler):
    slow, other = server.dealer(), server.dealer()
    _send(slow, 1, Release(request_ids=["long:gate"]))
    _send(other, 7, Release(request_ids=["quick"]))
    assert _reply(other) == (7, ReleaseReply(released=["quick"]))
    _send(other, 8, Heartbeat(seq=3, sent_at=1.0))
    call, beat = _reply(other)
    assert call == 8 and isinstance(beat, HeartbeatReply) and beat.seq == 3
    assert not slow.poll(100, zmq.POLLIN), "the open call was answered before its work ended"
    assert handler.opened["long"].slices >= 2  # it advanced between those messages
    handler.gate.set()
    assert _reply(slow) == (1, ReleaseReply(released=["long"]))


def test_open_calls_share_the_slices(server, handler):
    peer = server.dealer()
    _send(peer, 1, Release(request_ids=["long:gate"]))
    _send(peer, 2, Release(request_ids=["short:3"]))
    # the short call ends first although the long one opened first and never ends alone
    assert _reply(peer) == (2, ReleaseReply(released=["short"]))
    handler.gate.set()
    assert _reply(peer) == (1, ReleaseReply(released=["long"]))
    assert handler.opened["short"].slices == 3


def test_a_slice_that_raises_answers_its_caller_and_the_loop_goes_on(server, handler):
    peer = server.dealer()
    _send(peer, 5, Release(request_ids=["boom:9"]))
    call, error = _reply(peer)
    assert call == 5 and isinstance(error, Error) and error.code == ErrorCode.INTERNAL
    assert "RuntimeError: slice 2 exploded" in error.message
    assert server.errors[ErrorCode.INTERNAL] == 1
    _send(peer, 6, Release(request_ids=["after"]))
    assert _reply(peer) == (6, ReleaseReply(released=["after"]))


def test_stopping_abandons_open_calls_and_tells_their_callers(ctx, handler):
    # Its own loop, so the socket stays open after the loop returns until the reply it made
    # on the way out has been read (no race with closing it).
    router = make_socket(ctx, "router", linger_ms=0)
    server = Server(ctx, bind(router, "tcp://127.0.0.1:*"))
    stop = threading.Event()
    loop = threading.Thread(target=serve_forever, args=(router, handler, stop), daemon=True,
                            kwargs=dict(requests=DRAFT_REQUESTS, responses=DRAFT_RESPONSES,
                                        on_error=server.count_error, poll_ms=20))  # fmt: skip
    loop.start()
    peer = server.dealer()
    _send(peer, 4, Release(request_ids=["long:gate"]))
    _send(peer, 5, Release(request_ids=["quick"]))
    assert _reply(peer) == (5, ReleaseReply(released=["quick"]))  # the long one is open
    stop.set()
    loop.join(timeout=T)
    assert not loop.is_alive()
    call, error = _reply(peer)
    router.close(linger=0)
    assert call == 4 and isinstance(error, Error) and error.code == ErrorCode.INTERNAL
    assert error.message == "service stopping: Release not done"
    assert handler.opened["long"].abandoned


class SlowSlice(Deferred):
    """One slice that takes `seconds`, telling `started` when it begins."""

    def __init__(self, seconds: float, started: threading.Event) -> None:
        self.seconds, self.started = seconds, started

    def advance(self) -> Any | None:
        self.started.set()
        time.sleep(self.seconds)
        return ReleaseReply(released=["slow"])


def test_a_message_that_waits_behind_a_slice_is_told_so(ctx):
    """QueueClock: a message sent while a 0.5 s slice runs reads the slice as its wait (at
    most: what the services report as "queued"), not the slow handling of the message
    before; one that arrives while the loop waits, or that opens the slice, about nothing."""
    started, waited = threading.Event(), {}
    clock = QueueClock()

    def handler(msg: Any, frames: list[zmq.Frame]) -> Any:
        name = msg.request_ids[0]
        waited[name] = clock.waited()
        if name != "slow":
            return ReleaseReply(released=[name])
        time.sleep(0.4)  # its own handling is not what the next message waits behind
        return SlowSlice(0.5, started)

    router = make_socket(ctx, "router", linger_ms=0)
    server = Server(ctx, bind(router, "tcp://127.0.0.1:*"))
    stop = threading.Event()
    loop = threading.Thread(target=serve_forever, args=(router, handler, stop), daemon=True,
                            kwargs=dict(requests=DRAFT_REQUESTS, responses=DRAFT_RESPONSES,
                                        poll_ms=1000, clock=clock))  # fmt: skip
    loop.start()
    try:
        peer = server.dealer()
        time.sleep(0.3)  # the loop waits for a message meanwhile
        _send(peer, 1, Release(request_ids=["idle"]))
        assert _reply(peer) == (1, ReleaseReply(released=["idle"]))
        t0 = time.perf_counter()
        _send(peer, 2, Release(request_ids=["slow"]))
        assert started.wait(T)
        _send(peer, 3, Release(request_ids=["behind"]))
        replies = dict([_reply(peer), _reply(peer)])
        assert replies == {2: ReleaseReply(released=["slow"]), 3: ReleaseReply(released=["behind"])}
        # it came during the slice: the bound is the slice (from the loop's last look at an
        # empty socket, just before the slice), never more than the whole exchange
        assert 0.45 <= waited["behind"] <= min(0.7, time.perf_counter() - t0)
        assert waited["idle"] < 0.1 and waited["slow"] < 0.1
    finally:
        stop.set()
        loop.join(timeout=T)
        router.close(linger=0)


def test_a_message_that_waits_behind_idle_work_is_told_only_that(ctx):
    """on_idle work (a graph warm-up) runs after a poll of poll_ms finds nothing: a message
    that comes during it waited for the idle work, not for the poll before it."""
    started, waited = threading.Event(), []
    clock = QueueClock()

    def idle() -> None:
        if not started.is_set():
            started.set()
            time.sleep(0.4)

    def handler(msg: Any, frames: list[zmq.Frame]) -> Any:
        waited.append(clock.waited())
        return ReleaseReply(released=msg.request_ids)

    router = make_socket(ctx, "router", linger_ms=0)
    server = Server(ctx, bind(router, "tcp://127.0.0.1:*"))
    stop = threading.Event()
    loop = threading.Thread(target=serve_forever, args=(router, handler, stop), daemon=True,
                            kwargs=dict(requests=DRAFT_REQUESTS, responses=DRAFT_RESPONSES,
                                        poll_ms=1000, on_idle=idle, clock=clock))  # fmt: skip
    loop.start()
    try:
        peer = server.dealer()
        assert started.wait(T)  # after one empty poll of 1 s
        _send(peer, 1, Release(request_ids=["during"]))
        assert _reply(peer) == (1, ReleaseReply(released=["during"]))
        assert 0.2 <= waited[0] <= 0.6
    finally:
        stop.set()
        loop.join(timeout=T)
        router.close(linger=0)


class NappingHandler(SlicedHandler):
    """SlicedHandler whose "nap:n" call sleeps 0.2 s before opening (messages queue), and
    which notes how many slices every open call had run when each call opened."""

    def __init__(self) -> None:
        super().__init__()
        self.slices_at_open: dict[str, int] = {}

    def __call__(self, msg: Any, frames: list[zmq.Frame]) -> Any:
        name = msg.request_ids[0].partition(":")[0]
        self.slices_at_open[name] = sum(w.slices for w in self.opened.values())
        if name == "nap":
            time.sleep(0.2)
        return super().__call__(msg, frames)


def test_deferred_calls_waiting_together_all_open_before_the_next_slice(ctx):
    """Calls that queue while the loop is busy are opened in a row, so the first slice
    sees them all (the verify server packs such Prefills into one forward); a message
    answered at once is still followed by a slice."""
    handler = NappingHandler()
    for server in start_server(ctx, handler):
        peer = server.dealer()
        _send(peer, 1, Release(request_ids=["nap:2"]))
        time.sleep(0.05)  # inside nap's handling: the next three queue
        for call, name in ((2, "a:2"), (3, "b:2"), (4, "c:2")):
            _send(peer, call, Release(request_ids=[name]))
        replies = dict(_reply(peer) for _ in range(4))
        assert set(replies) == {1, 2, 3, 4}
        assert handler.slices_at_open == {"nap": 0, "a": 0, "b": 0, "c": 0}
        # answered at once, then a slice: the open call advances between quick messages
        _send(peer, 5, Release(request_ids=["long:gate"]))
        for call in (6, 7, 8):
            _send(peer, call, Release(request_ids=["quick"]))
            assert _reply(peer) == (call, ReleaseReply(released=["quick"]))
        assert handler.opened["long"].slices >= 3
        handler.gate.set()
        assert _reply(peer) == (5, ReleaseReply(released=["long"]))
