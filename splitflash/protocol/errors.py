"""Exceptions raised by the wire protocol.

`ProtocolError` subclasses `ValueError` so that a message constructor's own checks (run in
`__post_init__`) are turned into validation errors by msgspec when they fail on decode.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """A frame or message that does not follow the protocol (malformed, unknown, invalid)."""


class ProtocolMismatch(ProtocolError):
    """The peer speaks another protocol version; the connection must not be used."""

    def __init__(self, message: str, *, local_version: int, remote_version: int | None) -> None:
        super().__init__(message)
        self.local_version = local_version
        # None when the peer's refusal did not carry its version in a typed field.
        self.remote_version = remote_version


class PeerTimeout(TimeoutError):
    """No reply (or no send slot) from a peer within the allowed time."""


class RemoteError(ProtocolError):
    """The peer answered a call with an `Error` message."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}")
        self.code = code
        self.request_id = request_id
