"""DEALER clients: late replies to abandoned calls, and the asyncio client of the gateway."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import zmq
import zmq.asyncio

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    VERIFY_REQUESTS,
    VERIFY_RESPONSES,
    AsyncClient,
    Client,
    Heartbeat,
    HeartbeatReply,
    Hello,
    PeerTimeout,
    ProtocolError,
    ProtocolMismatch,
    Release,
    ReleaseReply,
    async_handshake,
    bind,
    make_hello,
    make_socket,
    recv,
    router_send,
)
from tests.unit.test_protocol_support import Server, T, start_server, tracking_context

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    yield from tracking_context()


@pytest.fixture
def server(ctx: zmq.Context) -> Iterator[Server]:
    yield from start_server(ctx)


def test_late_reply_to_a_timed_out_call_is_dropped(ctx: zmq.Context) -> None:
    router = make_socket(ctx, "router")
    stale: list[int] = []
    client = Client(
        make_socket(ctx, "dealer"),
        DRAFT_REQUESTS,
        DRAFT_RESPONSES,
        on_stale=lambda: stale.append(1),
    )
    client.sock.connect(bind(router, "tcp://127.0.0.1:*"))
    with pytest.raises(PeerTimeout, match="no reply to Heartbeat"):
        client.call(Heartbeat(seq=1, sent_at=1.0), timeout_s=0.1)
    first = recv(router, DRAFT_REQUESTS, router=True, timeout_ms=int(T * 1000))

    def slow_server() -> None:  # answers the abandoned call first, then the live one
        second = recv(router, DRAFT_REQUESTS, router=True, timeout_ms=int(T * 1000))
        for inc in (first, second):
            reply = HeartbeatReply(seq=inc.msg.seq, sent_at=1.0, replied_at=2.0)
            router_send(router, inc.peer, inc.call_id, reply, DRAFT_RESPONSES)

    thread = threading.Thread(target=slow_server, daemon=True)
    thread.start()
    reply, _ = client.call(Heartbeat(seq=2, sent_at=1.0), timeout_s=T)
    thread.join(T)
    router.close(0)
    assert reply.seq == 2 and stale == [1]


# ------------------------------------------------------------------ asyncio client (gateway)


def test_async_client_runs_concurrent_calls_and_handshake(server: Server) -> None:
    async def main() -> None:
        actx = zmq.asyncio.Context()
        sock = make_socket(actx, "dealer", linger_ms=0)
        sock.connect(server.endpoint)
        client = AsyncClient(sock, DRAFT_REQUESTS, DRAFT_RESPONSES)
        try:
            reply = await async_handshake(client, make_hello("gateway", "gw"), timeout_s=T)
            assert reply.target_layer_ids == [1, 3]
            calls = [client.call(Heartbeat(seq=i, sent_at=1.0), timeout_s=T) for i in range(20)]
            calls.append(client.call(Release(request_ids=["a"]), timeout_s=T))
            replies = await asyncio.gather(*calls)
            assert [r.seq for r, _ in replies[:20]] == list(range(20))
            assert replies[20][0] == ReleaseReply(released=["a"])
            with pytest.raises(ProtocolMismatch, match="peer speaks 7"):
                bad = Hello(protocol_version=7, service="gateway", peer_id="gw")
                await async_handshake(client, bad, timeout_s=T)
        finally:
            await client.aclose()
            sock.close(0)
            actx.term()

    asyncio.run(asyncio.wait_for(main(), timeout=30))


def test_async_call_times_out_and_closing_fails_waiters(ctx: zmq.Context) -> None:
    router = make_socket(ctx, "router")  # never answers
    endpoint = bind(router, "tcp://127.0.0.1:*")

    async def main() -> None:
        actx = zmq.asyncio.Context()
        sock = make_socket(actx, "dealer", linger_ms=0)
        sock.connect(endpoint)
        client = AsyncClient(sock, VERIFY_REQUESTS, VERIFY_RESPONSES)
        try:
            with pytest.raises(PeerTimeout, match="no reply to Heartbeat"):
                await client.call(Heartbeat(seq=1, sent_at=1.0), timeout_s=0.1)
            waiter = asyncio.create_task(client.call(Heartbeat(seq=2, sent_at=1.0), timeout_s=T))
            for _ in range(1000):  # let the call get in flight (bounded; no peer involved)
                if client.in_flight:
                    break
                await asyncio.sleep(0.001)
            await client.aclose()
            with pytest.raises(ProtocolError, match="reply reader stopped"):
                await waiter
        finally:
            sock.close(0)
            actx.term()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    router.close(0)
