"""Sockets, handshake and server loop over real tcp://127.0.0.1 sockets.

Every wait is bounded (call timeouts, thread joins, and a pytest-timeout cap per test).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq
import zmq.asyncio

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    PROTOCOL_VERSION,
    Client,
    Error,
    ErrorCode,
    Features,
    FeaturesAck,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    PeerTimeout,
    ProtocolMismatch,
    Release,
    ReleaseReply,
    RemoteError,
    bind,
    decode_tensor,
    encode_tensor,
    handshake,
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


# ------------------------------------------------------------------ sockets


def test_make_socket_sets_every_option(ctx: zmq.Context) -> None:
    sock = make_socket(
        ctx, "dealer", identity=b"gw-1", hwm=7, linger_ms=3, rcvtimeo_ms=11, sndtimeo_ms=13
    )
    try:
        assert sock.getsockopt(zmq.IDENTITY) == b"gw-1"
        assert (sock.getsockopt(zmq.SNDHWM), sock.getsockopt(zmq.RCVHWM)) == (7, 7)
        assert sock.getsockopt(zmq.LINGER) == 3
        assert (sock.getsockopt(zmq.RCVTIMEO), sock.getsockopt(zmq.SNDTIMEO)) == (11, 13)
        assert sock.getsockopt(zmq.IMMEDIATE) == 1
    finally:
        sock.close(0)
    with pytest.raises(ValueError, match="router"):
        make_socket(ctx, "pub", hwm=1, linger_ms=0)  # type: ignore[arg-type]


def test_bind_resolves_a_random_port(ctx: zmq.Context) -> None:
    sock = make_socket(ctx, "router")
    try:
        endpoint = bind(sock, "tcp://127.0.0.1:*")
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith(":*")
    finally:
        sock.close(0)


def test_send_without_a_connected_peer_times_out(ctx: zmq.Context) -> None:
    client = Client(make_socket(ctx, "dealer"), DRAFT_REQUESTS, DRAFT_RESPONSES)
    client.sock.connect("tcp://127.0.0.1:1")  # nobody listens: IMMEDIATE keeps nothing queued
    start = time.monotonic()
    with pytest.raises(PeerTimeout, match="send slot"):
        client.call(Heartbeat(seq=1, sent_at=time.time()), timeout_s=0.2)
    assert time.monotonic() - start < T


# ------------------------------------------------------------------ handshake


def test_handshake_accepts_the_same_version(server: Server) -> None:
    reply = handshake(server.client(), make_hello("gateway", "gw-0"), timeout_s=T)
    assert reply == HelloReply(
        protocol_version=PROTOCOL_VERSION,
        service="draft",
        model="tiny",
        info={"device": "cpu"},
        target_layer_ids=[1, 3],
    )


def test_version_mismatch_is_refused_naming_both_versions(server: Server) -> None:
    old = Hello(protocol_version=PROTOCOL_VERSION + 41, service="gateway", peer_id="gw-0")
    with pytest.raises(ProtocolMismatch) as info:
        handshake(server.client(), old, timeout_s=T)
    assert f"peer speaks {PROTOCOL_VERSION + 41}" in str(info.value)
    assert f"this service speaks {PROTOCOL_VERSION}" in str(info.value)
    assert server.errors[ErrorCode.PROTOCOL_VERSION] == 1


def test_newer_hello_our_schema_cannot_read_still_gets_a_version_error(server: Server) -> None:
    sock = server.dealer()
    newer = msgspec.msgpack.encode(
        {
            "type": "Hello",
            "protocol_version": 9,
            "service": "gw",
            "peer_id": "p",
            "field_of_v9": [1],
        }
    )
    sock.send_multipart([b"", b"c1", newer])
    reply = recv(sock, DRAFT_RESPONSES, router=False, timeout_ms=int(T * 1000))
    assert reply.call_id == b"c1"
    assert reply.msg.code == ErrorCode.PROTOCOL_VERSION and "peer speaks 9" in reply.msg.message


def test_client_refuses_a_server_of_another_version(ctx: zmq.Context) -> None:
    router = make_socket(ctx, "router")
    client = Client(make_socket(ctx, "dealer"), DRAFT_REQUESTS, DRAFT_RESPONSES)
    client.sock.connect(bind(router, "tcp://127.0.0.1:*"))

    def old_server() -> None:  # answers with its own (other) version instead of refusing
        inc = recv(router, DRAFT_REQUESTS, router=True, timeout_ms=int(T * 1000))
        reply = HelloReply(protocol_version=0, service="draft", model="m")
        router_send(router, inc.peer, inc.call_id, reply, DRAFT_RESPONSES)

    thread = threading.Thread(target=old_server, daemon=True)
    thread.start()
    with pytest.raises(
        ProtocolMismatch,
        match=f"draft speaks protocol version 0, this side speaks {PROTOCOL_VERSION}",
    ):
        handshake(client, make_hello("gateway", "gw"), timeout_s=T)
    thread.join(T)
    router.close(0)


# ------------------------------------------------------------------ server loop


@pytest.mark.parametrize(
    ("frames", "call_id"),
    [
        ([b"", b"c7", b"\xc1garbage"], b"c7"),  # bad payload: reply keeps the call id
        ([b"", b"c8", msgspec.msgpack.encode({"type": "Verify", "items": []})], b"c8"),
        ([b"only-one-frame"], b""),  # bad envelope: reply belongs to no call
        ([b"x", b"c9", b"payload"], b""),  # non-empty delimiter
        ([b"", b"c" * 33, b"payload"], b""),  # oversized call id
    ],
)
def test_garbage_gets_error_and_the_loop_keeps_serving(
    server: Server, frames: list[bytes], call_id: bytes
) -> None:
    sock = server.dealer()
    sock.send_multipart(frames)
    reply = recv(sock, DRAFT_RESPONSES, router=False, timeout_ms=int(T * 1000))
    assert isinstance(reply.msg, Error) and reply.msg.code == ErrorCode.MALFORMED
    assert reply.call_id == call_id
    assert server.errors[ErrorCode.MALFORMED] == 1
    # Same connection, next message: served normally.
    assert (
        handshake(
            Client(sock, DRAFT_REQUESTS, DRAFT_RESPONSES), make_hello("gw", "p"), timeout_s=T
        ).model
        == "tiny"
    )


def test_heartbeat_is_answered_by_the_loop(server: Server) -> None:
    sent = time.time()
    reply, frames = server.client().call(
        Heartbeat(seq=42, sent_at=sent), timeout_s=T, expect=HeartbeatReply
    )
    assert (reply.seq, reply.sent_at, frames) == (42, sent, [])
    assert reply.replied_at >= sent


@pytest.mark.parametrize(
    ("request_id", "code", "needle"),
    [
        ("boom", ErrorCode.INTERNAL, "RuntimeError: engine exploded"),
        ("bad", ErrorCode.BAD_REQUEST, "request bad is refused"),
        ("wrong-type", ErrorCode.INTERNAL, "Heartbeat is not a DraftResponse"),
    ],
)
def test_handler_failures_become_errors(
    server: Server, request_id: str, code: str, needle: str
) -> None:
    client = server.client()
    with pytest.raises(RemoteError, match=needle) as info:
        client.call(Release(request_ids=[request_id]), timeout_s=T, expect=ReleaseReply)
    assert info.value.code == code and server.errors[code] == 1
    reply, _ = client.call(Release(request_ids=["ok"]), timeout_s=T, expect=ReleaseReply)
    assert reply.released == ["ok"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_features_travel_with_a_tensor_frame_both_ways(server: Server, dtype: torch.dtype) -> None:
    t = torch.randn(3, 2 * 16).to(dtype)[:, ::2]  # non-contiguous on purpose
    header, raw = encode_tensor(t)
    msg = Features(
        request_id="r1",
        start_pos=10,
        n_tokens=3,
        layer_ids=[1, 3],
        dtype=header.dtype,
        shape=header.shape,
    )
    ack, frames = server.client().call(msg, [raw], timeout_s=T, expect=FeaturesAck)
    assert ack.end_pos == 13 and len(frames) == 1
    assert torch.equal(decode_tensor(msg, frames[0]), t * 2)
