"""The Hello handshake on a DEALER client: versions checked, a refusal named (both versions)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitflash.protocol.client import AsyncClient, Client
from splitflash.protocol.codec import probe_protocol_version
from splitflash.protocol.errors import ProtocolError, ProtocolMismatch, RemoteError
from splitflash.protocol.messages import PROTOCOL_VERSION, Error, ErrorCode, Hello, HelloReply
from splitflash.protocol.sockets import MalformedFrame


def make_hello(service: str, peer_id: str, wants_target_layers: Sequence[int] = ()) -> Hello:
    return Hello(
        protocol_version=PROTOCOL_VERSION,
        service=service,
        peer_id=peer_id,
        wants_target_layers=list(wants_target_layers),
    )


def check_hello_reply(reply: Any) -> HelloReply:
    """The HelloReply, or ProtocolMismatch / RemoteError naming what went wrong."""
    if isinstance(reply, HelloReply):
        if reply.protocol_version != PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"{reply.service} speaks protocol version {reply.protocol_version}, "
                f"this side speaks {PROTOCOL_VERSION}",
                local_version=PROTOCOL_VERSION,
                remote_version=reply.protocol_version,
            )
        return reply
    if isinstance(reply, Error):
        if reply.code == ErrorCode.PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"peer refused protocol version {PROTOCOL_VERSION}: {reply.message}",
                local_version=PROTOCOL_VERSION,
                remote_version=None,
            )
        raise RemoteError(reply.code, reply.message, reply.request_id)
    raise ProtocolError(f"expected HelloReply to Hello, got {type(reply).__name__}")


def _mismatch_from_undecodable(e: MalformedFrame) -> ProtocolMismatch | None:
    remote = probe_protocol_version(e.payload) if e.payload is not None else None
    if remote is None or remote == PROTOCOL_VERSION:
        return None
    return ProtocolMismatch(
        f"peer replied with protocol version {remote} (unreadable here: {e}), "
        f"this side speaks {PROTOCOL_VERSION}",
        local_version=PROTOCOL_VERSION,
        remote_version=remote,
    )


def handshake(client: Client, hello: Hello, *, timeout_s: float) -> HelloReply:
    """Send Hello, wait for HelloReply; ProtocolMismatch (both versions named) if refused."""
    try:
        reply, _ = client.call(hello, timeout_s=timeout_s)
    except MalformedFrame as e:
        raise (_mismatch_from_undecodable(e) or e) from e
    return check_hello_reply(reply)


async def async_handshake(client: AsyncClient, hello: Hello, *, timeout_s: float) -> HelloReply:
    try:
        reply, _ = await client.call(hello, timeout_s=timeout_s)
    except MalformedFrame as e:
        raise (_mismatch_from_undecodable(e) or e) from e
    return check_hello_reply(reply)
