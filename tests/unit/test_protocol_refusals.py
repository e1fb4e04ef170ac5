"""Wire messages: malformed, unknown or invalid input is refused with a clear ProtocolError."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitflash.protocol import (
    PROTOCOL_VERSION,
    VERIFY_REQUESTS,
    Draft,
    Features,
    Heartbeat,
    ProposeItem,
    ProtocolError,
    VerifyItem,
    probe_protocol_version,
)
from tests.unit.test_protocol import CODECS


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_arbitrary_bytes_raise_protocol_error_only(junk: bytes) -> None:
    for codec, _ in CODECS:
        with contextlib.suppress(ProtocolError):  # any other exception fails the test
            codec.decode(junk)


def _wire(obj: dict) -> bytes:
    return msgspec.msgpack.encode(obj)


VALID_VERIFY_ITEM = {
    "request_id": "r",
    "deadline": 1.0,
    "base_len": 5,
    "draft_ids": [1, 2],
    "max_commit": 3,
}


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (b"\xc1", "malformed VerifyRequest"),
        (b"", "malformed VerifyRequest"),
        (_wire({"type": "Open"}), "Invalid value 'Open'"),
        (_wire({"seq": 1, "sent_at": 1.0}), "missing required field `type`"),
        (_wire([1, 2, 3]), "Expected `object`"),
        (_wire({"type": "Heartbeat", "seq": 1}), "missing required field `sent_at`"),
        (_wire({"type": "Heartbeat", "seq": 1, "sent_at": 1.0, "x": 1}), "unknown field `x`"),
        (_wire({"type": "Heartbeat", "seq": -1, "sent_at": 1.0}), ">= 0"),
        (_wire({"type": "Heartbeat", "seq": 1, "sent_at": float("nan")}), ">= 0"),
        (_wire({"type": "Heartbeat", "seq": "1", "sent_at": 1.0}), "Expected `int`"),
        (_wire({"type": "Verify", "items": []}), "length >= 1"),
        (_wire({"type": "Verify", "items": [{**VALID_VERIFY_ITEM, "base_len": 0}]}), ">= 1"),
        (
            _wire({"type": "Verify", "items": [{**VALID_VERIFY_ITEM, "draft_parents": [-1]}]}),
            "1 parents for 2 draft nodes",
        ),
        (
            _wire({"type": "Verify", "items": [{**VALID_VERIFY_ITEM, "draft_parents": [-1, 1]}]}),
            "node 1 has parent 1",
        ),
        (
            _wire({"type": "Verify", "items": [{**VALID_VERIFY_ITEM, "request_id": ""}]}),
            "length >= 1",
        ),
    ],
)
def test_invalid_messages_are_refused_with_a_clear_error(payload: bytes, needle: str) -> None:
    with pytest.raises(ProtocolError, match=needle.replace("(", r"\(").replace("`", ".")):
        VERIFY_REQUESTS.decode(payload)


def test_constructors_check_structure_too() -> None:
    with pytest.raises(ProtocolError, match="parent 0"):
        VerifyItem(
            request_id="r",
            deadline=1.0,
            base_len=3,
            draft_ids=[1, 2],
            draft_parents=[0, -1],
            max_commit=2,
        )
    with pytest.raises(ProtocolError, match="parents for"):
        Draft(request_id="r", token_ids=[1], parents=[], base_len=3)
    with pytest.raises(ProtocolError, match="exceed base_len"):
        ProposeItem(request_id="r", deadline=1.0, base_len=1, last_ids=[1, 2], max_drafts=3)
    with pytest.raises(ProtocolError, match="n_tokens=3"):
        Features(
            request_id="r", start_pos=0, n_tokens=3, layer_ids=[1], dtype="float32", shape=[2, 8]
        )
    with pytest.raises(TypeError):
        Heartbeat(1, 2.0)  # type: ignore[misc]  # keyword-only: no silent int mix-ups


def test_probe_reads_the_version_of_a_hello_our_schema_refuses() -> None:
    newer = _wire(
        {"type": "Hello", "protocol_version": 2, "service": "gw", "peer_id": "p", "new_field": True}
    )
    with pytest.raises(ProtocolError):
        VERIFY_REQUESTS.decode(newer)
    assert probe_protocol_version(newer) == 2
    assert probe_protocol_version(_wire({"type": "Heartbeat", "protocol_version": 2})) is None
    assert probe_protocol_version(b"\xc1") is None
    assert PROTOCOL_VERSION == 1
