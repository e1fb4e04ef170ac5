"""One tagged union per socket and its encoder/decoder (validating, never pickle).

Sockets (DESIGN.md §3):
- verify ROUTER <- gateway DEALER: `VerifyRequest` in, `VerifyResponse` out.
- draft ROUTER <- gateway DEALER and verify DEALER (data plane, `Features` + tensor frame):
  `DraftRequest` in, `DraftResponse` out.
"""

from __future__ import annotations

import typing
from typing import Any, Generic, TypeVar

import msgspec

from splitflash.protocol.errors import ProtocolError
from splitflash.protocol.messages import (
    Error,
    Features,
    FeaturesAck,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Open,
    OpenReply,
    Prefill,
    PrefillReply,
    Propose,
    ProposeReply,
    Release,
    ReleaseReply,
    Verify,
    VerifyReply,
)

VerifyRequest = Hello | Heartbeat | Release | Prefill | Verify
VerifyResponse = HelloReply | HeartbeatReply | ReleaseReply | PrefillReply | VerifyReply | Error
DraftRequest = Hello | Heartbeat | Release | Open | Propose | Features
DraftResponse = (
    HelloReply | HeartbeatReply | ReleaseReply | OpenReply | ProposeReply | FeaturesAck | Error
)

M = TypeVar("M")


class Codec(Generic[M]):
    """Encoder + validating decoder for one socket direction's union.

    `encode` refuses a message that is not in the union: sending it would only produce a
    `malformed` Error on the peer, so the mistake is reported where it was made.
    """

    def __init__(self, name: str, union: Any) -> None:
        self.name = name
        self.types: tuple[type, ...] = typing.get_args(union)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(union)

    def encode(self, msg: M) -> bytes:
        if not isinstance(msg, self.types):
            raise ProtocolError(
                f"{type(msg).__name__} is not a {self.name} (expected one of {self.type_names()})"
            )
        return self._encoder.encode(msg)

    def decode(self, buf: bytes | bytearray | memoryview) -> M:
        """Decode and validate one payload (any buffer: zmq frames decode without a copy)."""
        try:
            return self._decoder.decode(buf)
        except msgspec.ValidationError as e:
            raise ProtocolError(f"invalid {self.name} ({self.type_names()}): {e}") from e
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed {self.name}: not a MessagePack message ({e})") from e

    def type_names(self) -> str:
        return ", ".join(t.__name__ for t in self.types)


VERIFY_REQUESTS: Codec[VerifyRequest] = Codec("VerifyRequest", VerifyRequest)
VERIFY_RESPONSES: Codec[VerifyResponse] = Codec("VerifyResponse", VerifyResponse)
DRAFT_REQUESTS: Codec[DraftRequest] = Codec("DraftRequest", DraftRequest)
DRAFT_RESPONSES: Codec[DraftResponse] = Codec("DraftResponse", DraftResponse)


class _VersionProbe(msgspec.Struct):
    """Lenient view of a Hello/HelloReply: readable even when a newer version changed fields."""

    type: str = ""
    protocol_version: int | None = None


def probe_protocol_version(buf: bytes | bytearray | memoryview) -> int | None:
    """The `protocol_version` of an undecodable Hello/HelloReply, else None.

    A peer of another version may send a Hello our schema refuses; this lets the refusal
    say "version X vs Y" instead of a generic schema error.
    """
    try:
        probe = msgspec.msgpack.decode(buf, type=_VersionProbe)
    except msgspec.DecodeError:
        return None
    if probe.type in ("Hello", "HelloReply"):
        return probe.protocol_version
    return None


__all__ = [
    "DRAFT_REQUESTS",
    "DRAFT_RESPONSES",
    "VERIFY_REQUESTS",
    "VERIFY_RESPONSES",
    "Codec",
    "DraftRequest",
    "DraftResponse",
    "VerifyRequest",
    "VerifyResponse",
    "probe_protocol_version",
]
