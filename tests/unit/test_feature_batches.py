"""A verify step's features to the drafter in one pipelined exchange (Client.call_many,
DraftLink.send_many) and one device->host copy (host_copies).

The stub peers below read EVERY message of a batch before answering any: a client that
waited for each reply before sending the next message would never get that far (its first
call would time out), so these tests fail on a non-pipelined client.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    Client,
    Error,
    Features,
    FeaturesAck,
    Heartbeat,
    HeartbeatReply,
    Hello,
    PeerTimeout,
    RemoteError,
    answer_hello,
    bind,
    decode_tensor,
    make_socket,
    recv,
    router_send,
)
from splitflash.services.verify import draft_link
from splitflash.services.verify.draft_link import DraftLink, host_copies
from tests.unit.test_protocol_support import T, tracking_context

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    yield from tracking_context()


def _router(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    sock = make_socket(ctx, "router", hwm=1000, linger_ms=0)
    return sock, bind(sock, "tcp://127.0.0.1:*")


def _in_thread(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def _read(router: zmq.Socket, n: int) -> list:
    return [recv(router, DRAFT_REQUESTS, router=True, timeout_ms=int(T * 1000)) for _ in range(n)]


def test_call_many_pipelines_and_returns_each_outcome_in_call_order(ctx) -> None:
    router, end = _router(ctx)
    client = Client(make_socket(ctx, "dealer"), DRAFT_REQUESTS, DRAFT_RESPONSES)
    client.sock.connect(end)

    def peer() -> None:  # all four read before any answer; answers in reverse, seq 3 never
        incs = _read(router, 4)
        for inc in reversed(incs):
            seq = inc.msg.seq
            if seq == 2:
                reply = Error(code="bad_request", message="seq 2 refused")
            elif seq != 3:
                reply = HeartbeatReply(seq=seq, sent_at=1.0, replied_at=2.0)
            else:
                continue
            router_send(router, inc.peer, inc.call_id, reply, DRAFT_RESPONSES)

    thread = _in_thread(peer)
    calls = [(Heartbeat(seq=i, sent_at=1.0), ()) for i in range(4)]
    outcomes = client.call_many(calls, timeout_s=1.0, expect=HeartbeatReply)
    thread.join(T)
    assert [o[0].seq for o in outcomes[:2]] == [0, 1]
    assert isinstance(outcomes[2], RemoteError) and "seq 2 refused" in str(outcomes[2])
    assert isinstance(outcomes[3], PeerTimeout) and "Heartbeat" in str(outcomes[3])


def test_call_many_timeout_bounds_each_wait_not_the_batch(ctx) -> None:
    """A peer that answers every 0.2 s keeps a 0.5 s batch alive for 0.8 s in all."""
    router, end = _router(ctx)
    client = Client(make_socket(ctx, "dealer"), DRAFT_REQUESTS, DRAFT_RESPONSES)
    client.sock.connect(end)

    def peer() -> None:
        for inc in _read(router, 4):
            time.sleep(0.2)
            reply = HeartbeatReply(seq=inc.msg.seq, sent_at=1.0, replied_at=2.0)
            router_send(router, inc.peer, inc.call_id, reply, DRAFT_RESPONSES)

    thread = _in_thread(peer)
    t0 = time.monotonic()
    calls = [(Heartbeat(seq=i, sent_at=1.0), ()) for i in range(4)]
    outcomes = client.call_many(calls, timeout_s=0.5, expect=HeartbeatReply)
    thread.join(T)
    assert time.monotonic() - t0 > 0.5  # longer than one timeout, and still no PeerTimeout
    assert [o[0].seq for o in outcomes] == [0, 1, 2, 3]


class _StubDrafter:
    """A draft ROUTER that answers Hello, then reads `expect` Features before acking them
    (refusing request "bad", never answering request "mute")."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.router, self.endpoint = _router(ctx)
        self.got: list[tuple[str, int, torch.Tensor]] = []

    def serve(self, expect: int, hello: bool) -> threading.Thread:
        def run() -> None:
            if hello:
                (inc,) = _read(self.router, 1)
                assert isinstance(inc.msg, Hello)
                reply = answer_hello(inc.msg, service="draft", model="stub")
                router_send(self.router, inc.peer, inc.call_id, reply, DRAFT_RESPONSES)
            incs = _read(self.router, expect)
            for inc in incs:
                msg = inc.msg
                assert isinstance(msg, Features)
                self.got.append((msg.request_id, msg.start_pos, decode_tensor(msg, inc.frames[0])))
                if msg.request_id == "mute":
                    continue
                error = "unknown_request: 'bad'" if msg.request_id == "bad" else None
                end = msg.start_pos + msg.n_tokens
                ack = FeaturesAck(request_id=msg.request_id, end_pos=end, error=error)
                router_send(self.router, inc.peer, inc.call_id, ack, DRAFT_RESPONSES)

        return _in_thread(run)


def _link(ctx, endpoint: str, failures: list[str], chunk_rows: int = 4) -> DraftLink:
    return DraftLink(
        ctx,
        endpoint,
        peer_id="verify-test",
        timeout_s=0.5,
        hello_timeout_s=T,
        retry_s=0.0,
        chunk_rows=chunk_rows,
        on_failure=failures.append,
    )


def test_send_many_delivers_chunks_of_several_requests_in_one_exchange(ctx) -> None:
    drafter, failures = _StubDrafter(ctx), []
    link = _link(ctx, drafter.endpoint, failures)
    a, b, bad = torch.randn(10, 6), torch.randn(3, 6), torch.randn(2, 6)
    thread = drafter.serve(expect=5, hello=True)  # a: 3 chunks of <= 4 rows, b: 1, bad: 1
    delivered = link.send_many([("a", 10, a), ("b", 0, b), ("bad", 5, bad)], (1, 3))
    thread.join(T)
    assert delivered == {"a": True, "b": True, "bad": False}
    assert [(rid, start, rows.shape[0]) for rid, start, rows in drafter.got] == [
        ("a", 10, 4), ("a", 14, 4), ("a", 18, 2), ("b", 0, 3), ("bad", 5, 2)
    ]  # fmt: skip
    assert torch.equal(torch.cat([r for rid, _, r in drafter.got if rid == "a"]), a)
    assert torch.equal(drafter.got[3][2], b)
    assert link.broken == {"bad"} and failures == ["features_refused"]

    # A request with a gap in its stream is not sent again; the others still are.
    thread = drafter.serve(expect=1, hello=False)
    assert link.send_many([("bad", 7, bad), ("b", 3, b[:1])], (1, 3)) == {
        "bad": False,
        "b": True,
    }
    thread.join(T)
    assert [rid for rid, _, _ in drafter.got[5:]] == ["b"]
    link.close()


def test_send_many_unanswered_chunk_breaks_only_its_request_and_counts_once(ctx) -> None:
    drafter, failures = _StubDrafter(ctx), []
    link = _link(ctx, drafter.endpoint, failures)
    thread = drafter.serve(expect=3, hello=True)
    rows = torch.randn(2, 6)
    delivered = link.send_many([("a", 0, rows), ("mute", 0, rows), ("b", 0, rows)], (1, 3))
    thread.join(T)
    assert delivered == {"a": True, "mute": False, "b": True}
    assert link.broken == {"mute"} and failures == ["features_timeout"]
    link.close()


def test_host_copies_are_fresh_and_equal_on_cpu() -> None:
    feats = [torch.randn(n, 5) for n in (3, 1, 7)]
    copies = host_copies(feats)
    assert [c.shape for c in copies] == [f.shape for f in feats]
    for c, f in zip(copies, feats, strict=True):
        assert torch.equal(c, f) and c.data_ptr() != f.data_ptr()
    feats[0].zero_()  # the engine may reuse its buffers: the copies must not follow
    assert not torch.equal(copies[0], feats[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("limit", [draft_link.PINNED_MAX_BYTES, 64])
def test_host_copies_from_the_gpu_equal_plain_copies(monkeypatch, limit: int) -> None:
    """Queued copies into pinned memory and one stream wait; past the limit, pageable."""
    monkeypatch.setattr(draft_link, "PINNED_MAX_BYTES", limit)
    gen = torch.Generator(device="cuda").manual_seed(0)
    feats = [
        torch.randn(n, 2880, device="cuda", generator=gen, dtype=torch.bfloat16)
        for n in (16, 3, 16, 1)
    ]
    torch.cuda._sleep(10_000_000)  # a busy stream: copies read before it drains would differ
    feats = [f * 2 for f in feats]
    copies = host_copies(feats)
    for c, f in zip(copies, feats, strict=True):
        assert c.device.type == "cpu" and torch.equal(c, f.cpu())
        assert c.is_pinned() == (limit > 64)
