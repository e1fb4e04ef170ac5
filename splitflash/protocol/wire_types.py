"""Base classes and constrained field types of the wire messages (see `messages.py`)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from splitflash.protocol.errors import ProtocolError

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
TokenId = Annotated[int, msgspec.Meta(ge=0)]
RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
# ge=0 also refuses NaN, which would make every deadline comparison false.
UnixTime = Annotated[float, msgspec.Meta(ge=0)]


class Message(
    msgspec.Struct,
    frozen=True,
    kw_only=True,
    tag=True,
    tag_field="type",
    forbid_unknown_fields=True,
):
    """Base of every top-level message (tagged with its class name)."""


class Item(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of the untagged structs nested inside messages."""


def check_tree_parents(parents: list[int] | None, n_nodes: int, what: str) -> None:
    """Tree parents must index earlier nodes (-1 = the root, the last committed token).

    Topological order lets both sides build the ancestor mask in one forward pass.
    """
    if parents is None:
        return
    if len(parents) != n_nodes:
        raise ProtocolError(f"{what}: {len(parents)} parents for {n_nodes} draft nodes")
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ProtocolError(f"{what}: node {i} has parent {p}; expected -1 <= parent < {i}")
