"""Wire messages (msgspec Structs, MessagePack). DESIGN.md §3 and §4.

Every top-level message is a tagged Struct: on the wire it is a map whose `type` key holds the
class name, so one msgspec decoder per socket validates and dispatches in one pass
(see `codec.py` for the unions). Nested items (`VerifyItem` ...) are untagged.

Conventions, shared by every message:
- `request_id`: the gateway's id of one client request (non-empty).
- `deadline`: absolute unix time (seconds, `time.time()`); work past it is wasted.
- `base_len`: a request's committed length = prompt tokens + tokens committed so far. Each
  side compares it with its own state and reports a desync as an error, never guesses.
- Constructors are keyword-only: several fields are adjacent ints (commit_len,
  accepted_drafts ...) and a positional mix-up would be silent.
- Unknown fields are refused: peers are deployed together and any change of fields bumps
  `PROTOCOL_VERSION`, which the `Hello` handshake checks.
- msgspec checks the `Meta` constraints on decode only; `__post_init__` checks (tree
  parents, lengths) run on construction as well.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import msgspec

from splitflash.protocol.draft_messages import (
    Draft,
    Features,
    FeaturesAck,
    Open,
    OpenReply,
    Propose,
    ProposeItem,
    ProposeReply,
)
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

PROTOCOL_VERSION = 1

# ---------------------------------------------------------------- common to every socket


class Hello(Message, kw_only=True):
    """First message of a client on a connection: its protocol version and who it is.

    `wants_target_layers`: the target layers whose hidden states this peer needs (the gateway
    forwards the drafter's `HelloReply.target_layer_ids` to verify; empty = none).
    """

    protocol_version: int
    service: str
    peer_id: str
    wants_target_layers: list[NonNegInt] = []


class HelloReply(Message, kw_only=True):
    """Accepts a `Hello`: the server's version, service name and loaded model.

    `target_layer_ids`: the target layers whose features this service consumes (a DFlash
    drafter's `target_layer_ids`; empty for ngram and for verify). `info`: free-form facts
    for logs and /ready (device, dtype, attention policy ...), never parsed for control.
    """

    protocol_version: int
    service: str
    model: str
    info: dict[str, str] = {}
    target_layer_ids: list[NonNegInt] = []


class Heartbeat(Message, kw_only=True):
    """Liveness probe; answered by the server loop itself, never by the engine."""

    seq: NonNegInt
    sent_at: UnixTime


class HeartbeatReply(Message, kw_only=True):
    """Echoes `seq` and `sent_at` (so the client measures round trip) plus the reply time."""

    seq: NonNegInt
    sent_at: UnixTime
    replied_at: UnixTime


class Error(Message, kw_only=True):
    """A request (or a whole frame) was refused. `code` is one of `ErrorCode`'s values."""

    code: str
    message: str
    request_id: str | None = None


class ErrorCode(StrEnum):
    """Values of `Error.code` (plain strings on the wire so new codes still decode)."""

    MALFORMED = "malformed"  # frame not decodable as this socket's request union
    PROTOCOL_VERSION = "protocol_version"  # Hello with another version
    BAD_REQUEST = "bad_request"  # decodable but refused by the engine's checks
    DESYNC = "desync"  # base_len differs from this side's state
    UNKNOWN_REQUEST = "unknown_request"  # request_id not open here
    DEADLINE = "deadline"  # deadline passed before the work was done
    OVERLOADED = "overloaded"
    INTERNAL = "internal"  # handler raised; the loop kept serving


class Release(Message, kw_only=True):
    """Frees all state of these requests (finish, abort, client disconnect). Idempotent."""

    request_ids: list[RequestId]


class ReleaseReply(Message, kw_only=True):
    """`released`: the ids that had state here (the others were unknown: not an error)."""

    released: list[str]


# ---------------------------------------------------------------- verify socket


class SamplingParams(Item, kw_only=True):
    """Target sampling. temperature 0 = greedy (lossless spec decoding); top_k 0 = off."""

    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    top_k: NonNegInt = 0
    seed: int | None = None


class PrefillItem(Item, kw_only=True):
    """Admit one request: run the prompt, keep its KV, commit the first token.

    `draft_peer`: the name (as configured on verify) of the draft endpoint that gets this
    request's target features as `Features` messages over verify's DEALER link to it;
    None = the drafter needs none (ngram, speculation off).
    """

    request_id: RequestId
    deadline: UnixTime
    prompt_ids: Annotated[list[TokenId], msgspec.Meta(min_length=1)]
    sampling: SamplingParams = SamplingParams()
    draft_peer: str | None = None


class Prefill(Message, kw_only=True):
    """A batch of requests to admit; answered by `PrefillReply` (one result each)."""

    items: Annotated[list[PrefillItem], msgspec.Meta(min_length=1)]


class VerifyItem(Item, kw_only=True):
    """One request's verify step: check the drafted nodes against the target.

    `base_len`: committed length the gateway believes; the target's must equal it.
    `draft_ids`: drafted nodes (may be empty: a plain target decode step, the fallback).
    `draft_parents`: None = chain; else one parent per node, -1 = the root (last committed
    token), each parent an earlier node. `max_commit`: most tokens this step may commit
    (remaining max_tokens), so the reply can end inside the step.
    """

    request_id: RequestId
    deadline: UnixTime
    base_len: PositiveInt
    draft_ids: list[TokenId]
    draft_parents: list[int] | None = None
    max_commit: PositiveInt

    def __post_init__(self) -> None:
        check_tree_parents(self.draft_parents, len(self.draft_ids), f"VerifyItem {self.request_id}")


class Verify(Message, kw_only=True):
    """A batch of verify steps (one per running request); answered by `VerifyReply`."""

    items: Annotated[list[VerifyItem], msgspec.Meta(min_length=1)]


class StepResult(Item, kw_only=True):
    """Outcome of one request's prefill or verify step (DESIGN.md §4 terms).

    `committed_ids`: tokens committed this step, in order; `commit_len` (c) = their count.
    `accepted_drafts` (a), `accepted_depth` (d), `draft_tokens` (K). `base_len`: the new
    committed length. The gateway checks the §4 invariants and counts violations; the
    protocol does not refuse them, so a broken step is visible instead of lost.
    `error`: set when this request failed (e.g. desync); the other results still stand.
    """

    request_id: str
    committed_ids: list[TokenId]
    commit_len: NonNegInt
    accepted_drafts: NonNegInt = 0
    accepted_depth: NonNegInt = 0
    draft_tokens: NonNegInt = 0
    base_len: NonNegInt
    finished_reason: str | None = None
    error: str | None = None


class PrefillReply(Message, kw_only=True):
    """Results of a `Prefill`, in item order. `timings`: phase name -> seconds."""

    results: list[StepResult]
    timings: dict[str, float] = {}


class VerifyReply(Message, kw_only=True):
    """Results of a `Verify`, in item order. `timings`: phase name -> seconds."""

    results: list[StepResult]
    timings: dict[str, float] = {}


__all__ = [
    "PROTOCOL_VERSION",
    "Draft",
    "Error",
    "ErrorCode",
    "Features",
    "FeaturesAck",
    "Heartbeat",
    "HeartbeatReply",
    "Hello",
    "HelloReply",
    "Item",
    "Message",
    "Open",
    "OpenReply",
    "Prefill",
    "PrefillItem",
    "PrefillReply",
    "Propose",
    "ProposeItem",
    "ProposeReply",
    "Release",
    "ReleaseReply",
    "SamplingParams",
    "StepResult",
    "Verify",
    "VerifyItem",
    "VerifyReply",
]
