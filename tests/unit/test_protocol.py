"""Wire messages: every type round-trips through its socket's codec; bad input is refused."""

from __future__ import annotations

import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    VERIFY_REQUESTS,
    VERIFY_RESPONSES,
    Codec,
    Draft,
    DraftRequest,
    DraftResponse,
    Error,
    ErrorCode,
    Features,
    FeaturesAck,
    Heartbeat,
    HeartbeatReply,
    Hello,
    HelloReply,
    Open,
    OpenReply,
    Prefill,
    PrefillItem,
    PrefillReply,
    Propose,
    ProposeItem,
    ProposeReply,
    ProtocolError,
    Release,
    ReleaseReply,
    SamplingParams,
    StepResult,
    Verify,
    VerifyItem,
    VerifyReply,
    VerifyRequest,
    VerifyResponse,
)

# ------------------------------------------------------------------ strategies

rid = st.text(min_size=1, max_size=16)
text = st.text(max_size=24)
tok = st.integers(0, 2**31 - 1)
toks = st.lists(tok, max_size=16)
nonneg = st.integers(0, 2**40)
pos = st.integers(1, 2**40)
unix = st.floats(0, 4e9, allow_nan=False)
timings = st.dictionaries(text, st.floats(allow_nan=False), max_size=4)
err = st.none() | text


@st.composite
def tree(draw: st.DrawFn) -> tuple[list[int], list[int] | None]:
    """Drafted node ids and parents (None = chain; else each parent an earlier node or -1)."""
    n = draw(st.integers(0, 12))
    ids = draw(st.lists(tok, min_size=n, max_size=n))
    parents = draw(st.none() | st.tuples(*[st.integers(-1, i - 1) for i in range(n)]).map(list))
    return ids, parents


sampling = st.builds(
    SamplingParams,
    temperature=st.floats(0, 10, allow_nan=False),
    top_p=st.floats(1e-6, 1.0, allow_nan=False),
    top_k=st.integers(0, 1000),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
)
step_result = st.builds(
    StepResult,
    request_id=rid,
    committed_ids=toks,
    commit_len=nonneg,
    accepted_drafts=nonneg,
    accepted_depth=nonneg,
    draft_tokens=nonneg,
    base_len=nonneg,
    finished_reason=st.none() | st.sampled_from(["stop", "length", "eos"]),
    error=err,
)


@st.composite
def verify_item(draw: st.DrawFn) -> VerifyItem:
    ids, parents = draw(tree())
    return VerifyItem(
        request_id=draw(rid),
        deadline=draw(unix),
        base_len=draw(pos),
        draft_ids=ids,
        draft_parents=parents,
        max_commit=draw(pos),
    )


@st.composite
def draft(draw: st.DrawFn) -> Draft:
    ids, parents = draw(tree())
    return Draft(
        request_id=draw(rid), token_ids=ids, parents=parents, base_len=draw(nonneg), error=draw(err)
    )


@st.composite
def propose_item(draw: st.DrawFn) -> ProposeItem:
    base_len = draw(pos)
    last = draw(st.lists(tok, max_size=min(base_len, 8)))
    return ProposeItem(
        request_id=draw(rid),
        deadline=draw(unix),
        base_len=base_len,
        last_ids=last,
        max_drafts=draw(st.integers(0, 64)),
    )


@st.composite
def features(draw: st.DrawFn) -> Features:
    n = draw(st.integers(0, 64))
    return Features(
        request_id=draw(rid),
        start_pos=draw(nonneg),
        n_tokens=n,
        layer_ids=draw(st.lists(st.integers(0, 80), max_size=6)),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        shape=[n, draw(st.integers(0, 8192))],
    )


def items(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(strategy, min_size=1, max_size=4)


STRATEGIES: dict[type, st.SearchStrategy] = {
    Hello: st.builds(
        Hello,
        protocol_version=st.integers(0, 100),
        service=text,
        peer_id=text,
        wants_target_layers=st.lists(st.integers(0, 100), max_size=6),
    ),
    HelloReply: st.builds(
        HelloReply,
        protocol_version=st.integers(0, 100),
        service=text,
        model=text,
        info=st.dictionaries(text, text, max_size=4),
        target_layer_ids=st.lists(st.integers(0, 100), max_size=6),
    ),
    Heartbeat: st.builds(Heartbeat, seq=nonneg, sent_at=unix),
    HeartbeatReply: st.builds(HeartbeatReply, seq=nonneg, sent_at=unix, replied_at=unix),
    Error: st.builds(
        Error,
        code=st.sampled_from(list(ErrorCode)) | text,
        message=text,
        request_id=st.none() | rid,
    ),
    Release: st.builds(Release, request_ids=st.lists(rid, max_size=5)),
    ReleaseReply: st.builds(ReleaseReply, released=st.lists(rid, max_size=5)),
    Prefill: st.builds(
        Prefill,
        items=items(
            st.builds(
                PrefillItem,
                request_id=rid,
                deadline=unix,
                prompt_ids=st.lists(tok, min_size=1, max_size=32),
                sampling=sampling,
                draft_peer=st.none() | text,
            )
        ),
    ),
    PrefillReply: st.builds(
        PrefillReply, results=st.lists(step_result, max_size=4), timings=timings
    ),
    Verify: st.builds(Verify, items=items(verify_item())),
    VerifyReply: st.builds(VerifyReply, results=st.lists(step_result, max_size=4), timings=timings),
    Open: st.builds(
        Open,
        request_id=rid,
        deadline=unix,
        prompt_ids=st.lists(tok, min_size=1, max_size=32),
        block_size=st.integers(1, 64),
    ),
    OpenReply: st.builds(OpenReply, request_id=rid, base_len=nonneg, error=err),
    Propose: st.builds(Propose, items=items(propose_item())),
    ProposeReply: st.builds(ProposeReply, drafts=st.lists(draft(), max_size=4), timings=timings),
    Features: features(),
    FeaturesAck: st.builds(FeaturesAck, request_id=rid, end_pos=nonneg, error=err),
}

CODECS: list[tuple[Codec, typing.Any]] = [
    (VERIFY_REQUESTS, VerifyRequest),
    (VERIFY_RESPONSES, VerifyResponse),
    (DRAFT_REQUESTS, DraftRequest),
    (DRAFT_RESPONSES, DraftResponse),
]
CASES = [
    pytest.param(codec, t, id=f"{codec.name}-{t.__name__}")
    for codec, union in CODECS
    for t in typing.get_args(union)
]


# ------------------------------------------------------------------ round trips


def test_every_message_type_has_a_strategy_and_a_socket() -> None:
    in_unions = {t for _, union in CODECS for t in typing.get_args(union)}
    assert in_unions == set(STRATEGIES)


@pytest.mark.parametrize(("codec", "msg_type"), CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_round_trip(codec: Codec, msg_type: type, data: st.DataObject) -> None:
    msg = data.draw(STRATEGIES[msg_type])
    wire = codec.encode(msg)
    assert codec.decode(wire) == msg
    # Decoding straight from a memoryview (what a zmq.Frame gives) is the same.
    assert codec.decode(memoryview(wire)) == msg


def test_wire_format_is_a_typed_map() -> None:
    wire = VERIFY_REQUESTS.encode(Heartbeat(seq=3, sent_at=1.5))
    assert msgspec.msgpack.decode(wire) == {"type": "Heartbeat", "seq": 3, "sent_at": 1.5}


def test_encode_refuses_a_message_of_another_socket() -> None:
    msg = Open(request_id="r", deadline=1.0, prompt_ids=[1], block_size=4)
    with pytest.raises(ProtocolError, match="Open is not a VerifyRequest"):
        VERIFY_REQUESTS.encode(msg)
