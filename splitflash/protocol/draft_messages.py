"""Draft-socket messages: gateway -> draft control, verify -> draft features (data plane).

Conventions as in `messages.py`, which re-exports every name here.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from splitflash.protocol.errors import ProtocolError
from splitflash.protocol.wire_types import (
    Item,
    Message,
    NonNegInt,
    PositiveInt,
    RequestId,
    TokenId,
    UnixTime,
    check_tree_parents,
)


class Open(Message, kw_only=True):
    """Create a request's draft state for its prompt; answered by `OpenReply`."""

    request_id: RequestId
    deadline: UnixTime
    prompt_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    block_size: PositiveInt


class OpenReply(Message, kw_only=True):
    """The drafter's state for `request_id` now covers `base_len` tokens, or `error`."""

    request_id: str
    base_len: NonNegInt
    error: str | None = None


class ProposeItem(Item, kw_only=True):
    """Ask for drafts for one request.

    `last_ids`: tokens committed since the previous call (so the drafter state stays in
    step); `base_len` counts them. `max_drafts`: node budget (0 = none this step).
    """

    request_id: RequestId
    deadline: UnixTime
    base_len: PositiveInt
    last_ids: list[TokenId]
    max_drafts: NonNegInt

    def __post_init__(self) -> None:
        if len(self.last_ids) > self.base_len:
            raise ProtocolError(
                f"ProposeItem {self.request_id}: {len(self.last_ids)} last_ids exceed "
                f"base_len {self.base_len}"
            )


class Propose(Message, kw_only=True):
    """A batch of draft requests; answered by `ProposeReply`."""

    items: Annotated[list[ProposeItem], msgspec.Meta(min_length=1)]


class Draft(Item, kw_only=True):
    """Drafted nodes for one request, rooted at its last committed token.

    `parents`: None = chain, else as `VerifyItem.draft_parents`. `base_len`: the drafter's
    committed length (must equal the request's). `error`: no drafts, and why.
    """

    request_id: str
    token_ids: list[TokenId]
    parents: list[int] | None = None
    base_len: NonNegInt
    error: str | None = None

    def __post_init__(self) -> None:
        check_tree_parents(self.parents, len(self.token_ids), f"Draft {self.request_id}")


class ProposeReply(Message, kw_only=True):
    """Drafts of a `Propose`, in item order. `timings`: phase name -> seconds."""

    drafts: list[Draft]
    timings: dict[str, float] = {}


class Features(Message, kw_only=True):
    """Target hidden features for positions [start_pos, start_pos + n_tokens) of a request.

    Sent by verify to draft as this header frame followed by ONE raw tensor frame of
    `dtype`/`shape` (see `tensors.py`), shape = (n_tokens, len(layer_ids) * hidden): the
    hidden states of `layer_ids`, concatenated in that order. Long prompts may come in
    several messages; the drafter refuses a `start_pos` other than its feature length.
    """

    request_id: RequestId
    start_pos: NonNegInt
    n_tokens: NonNegInt
    layer_ids: list[NonNegInt]
    dtype: str
    shape: list[NonNegInt]

    def __post_init__(self) -> None:
        if not self.shape or self.shape[0] != self.n_tokens:
            raise ProtocolError(
                f"Features {self.request_id}: shape {self.shape} does not start with "
                f"n_tokens={self.n_tokens}"
            )


class FeaturesAck(Message, kw_only=True):
    """The drafter now holds features up to `end_pos` for `request_id`, or `error`."""

    request_id: str
    end_pos: NonNegInt
    error: str | None = None
