"""Shared helpers of the protocol socket tests (no tests here): a draft-like test server.

Every wait is bounded: calls carry timeouts and threads are joined with a timeout, so a
broken peer fails a test instead of hanging it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    Client,
    Features,
    FeaturesAck,
    Heartbeat,
    Hello,
    ProtocolError,
    Release,
    ReleaseReply,
    answer_hello,
    bind,
    decode_tensor,
    encode_tensor,
    make_socket,
    serve_forever,
)

T = 5.0  # seconds: generous bound for any single call on a loaded CI machine


def echo_handler(msg: Any, frames: list[zmq.Frame]) -> Any:
    match msg:
        case Hello():
            return answer_hello(
                msg, service="draft", model="tiny", info={"device": "cpu"}, target_layer_ids=[1, 3]
            )
        case Release(request_ids=ids):
            if "boom" in ids:
                raise RuntimeError("engine exploded")
            if "bad" in ids:
                raise ProtocolError("request bad is refused")
            if "wrong-type" in ids:
                return Heartbeat(seq=1, sent_at=1.0)  # not a DraftResponse: a service bug
            return ReleaseReply(released=ids)
        case Features():
            t = decode_tensor(msg, frames[0])
            header, raw = encode_tensor(t * 2)  # echo back, doubled, as a reply tensor frame
            ack = FeaturesAck(
                request_id=msg.request_id,
                end_pos=msg.start_pos + msg.n_tokens,
                error=f"{header.dtype}{header.shape}",
            )
            return ack, [raw]
    raise AssertionError(f"unexpected {msg!r}")


@dataclass
class Server:
    ctx: zmq.Context
    endpoint: str
    errors: Counter = field(default_factory=Counter)

    def count_error(self, code: str) -> None:
        self.errors[code] += 1

    def dealer(self, identity: bytes | None = None) -> zmq.Socket:
        sock = make_socket(self.ctx, "dealer", identity=identity, hwm=100, linger_ms=0)
        sock.connect(self.endpoint)
        return sock

    def client(self, **kw: Any) -> Client:
        return Client(self.dealer(), DRAFT_REQUESTS, DRAFT_RESPONSES, **kw)


class TrackingContext(zmq.Context):
    """Keeps every socket it made so teardown closes them all, even ones a test dropped."""

    opened: list[zmq.Socket] | None = None  # pyzmq wants subclass attributes declared here

    def socket(self, *args: Any, **kwargs: Any) -> zmq.Socket:
        sock = super().socket(*args, **kwargs)
        if self.opened is None:
            self.opened = []
        self.opened.append(sock)
        return sock


def tracking_context() -> Iterator[zmq.Context]:
    """Body of the `ctx` fixture: a context whose sockets are all closed at teardown."""
    context = TrackingContext()
    yield context
    for sock in context.opened or []:
        sock.close(linger=0)
    context.term()


def start_server(ctx: zmq.Context, handler: Callable = echo_handler) -> Iterator[Server]:
    """Body of the `server` fixture: serve_forever on a random tcp port in a thread."""
    sock = make_socket(ctx, "router", hwm=100, linger_ms=0)
    server = Server(ctx, bind(sock, "tcp://127.0.0.1:*"))
    stop = threading.Event()
    thread = threading.Thread(
        target=serve_forever,
        args=(sock, handler, stop),
        kwargs=dict(
            requests=DRAFT_REQUESTS,
            responses=DRAFT_RESPONSES,
            on_error=server.count_error,
            poll_ms=20,
        ),
        daemon=True,
    )
    thread.start()
    yield server
    stop.set()
    thread.join(timeout=T)
    assert not thread.is_alive(), "serve_forever did not stop on stop_event"
    sock.close(0)
