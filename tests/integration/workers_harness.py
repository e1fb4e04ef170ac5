"""Test harness: verify/draft servers in threads on real tcp sockets, and a blocking client
that drives them exactly as the gateway does (Hello; Open + Prefill; Propose -> Verify
until finished; Release)."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field

import zmq

from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    VERIFY_REQUESTS,
    VERIFY_RESPONSES,
    Client,
    Open,
    OpenReply,
    Prefill,
    PrefillItem,
    PrefillReply,
    Propose,
    ProposeItem,
    ProposeReply,
    Release,
    ReleaseReply,
    Verify,
    VerifyItem,
    VerifyReply,
    handshake,
    make_hello,
    make_socket,
)

CALL_S = 30.0  # generous per-call timeout: a slow CI box must not flake


@contextlib.contextmanager
def running(server):
    """Serve in a thread; always stop and join (with a timeout) on the way out."""
    thread = threading.Thread(target=server.serve, daemon=True, name=type(server).__name__)
    thread.start()
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout=10)
        assert not thread.is_alive(), f"{type(server).__name__} did not stop"


@contextlib.contextmanager
def client_for(endpoint: str, service: str):
    ctx = zmq.Context()
    sock = make_socket(ctx, "dealer")
    sock.connect(endpoint)
    codecs = (
        (VERIFY_REQUESTS, VERIFY_RESPONSES)
        if service == "verify"
        else (DRAFT_REQUESTS, DRAFT_RESPONSES)
    )
    try:
        yield Client(sock, *codecs)
    finally:
        sock.close(linger=0)
        ctx.term()


@dataclass
class Run:
    """One request as the gateway tracks it."""

    rid: str
    prompt: list[int]
    max_tokens: int
    out: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)  # committed since the previous Propose
    finished: str | None = None
    results: list = field(default_factory=list)  # every StepResult, prefill first

    @property
    def base_len(self) -> int:
        return len(self.prompt) + len(self.out)


def deadline(seconds: float = CALL_S) -> float:
    return time.time() + seconds


def gateway_generate(
    verify: Client,
    draft: Client | None,
    runs: list[Run],
    block: int = 4,
    draft_peer: str | None = None,
    after_verify=None,
) -> None:
    """Lock-step batched decoding of `runs` over the two services (the gateway's loop)."""
    wants = ()
    if draft is not None:
        wants = handshake(draft, make_hello("gateway", "gw"), timeout_s=CALL_S).target_layer_ids
    handshake(verify, make_hello("gateway", "gw", wants), timeout_s=CALL_S)
    try:
        if draft is not None:
            for r in runs:
                reply, _ = draft.call(
                    Open(
                        request_id=r.rid, deadline=deadline(), prompt_ids=r.prompt, block_size=block
                    ),
                    timeout_s=CALL_S,
                    expect=OpenReply,
                )
                assert reply.error is None and reply.base_len == len(r.prompt)
        items = [
            PrefillItem(
                request_id=r.rid, deadline=deadline(), prompt_ids=r.prompt, draft_peer=draft_peer
            )
            for r in runs
        ]
        reply, _ = verify.call(Prefill(items=items), timeout_s=CALL_S, expect=PrefillReply)
        for r, res in zip(runs, reply.results, strict=True):
            _commit(r, res)
        while live := [r for r in runs if r.finished is None]:
            drafts = [[] for _ in live]
            if draft is not None:
                props = [
                    ProposeItem(
                        request_id=r.rid,
                        deadline=deadline(),
                        base_len=r.base_len,
                        last_ids=r.last,
                        max_drafts=block - 1,
                    )
                    for r in live
                ]
                reply, _ = draft.call(Propose(items=props), timeout_s=CALL_S, expect=ProposeReply)
                for r, d in zip(live, reply.drafts, strict=True):
                    assert d.error is None, d.error
                    assert d.base_len == r.base_len
                    r.last = []
                drafts = [d.token_ids for d in reply.drafts]
            items = [
                VerifyItem(
                    request_id=r.rid,
                    deadline=deadline(),
                    base_len=r.base_len,
                    draft_ids=ids,
                    max_commit=r.max_tokens - len(r.out),
                )
                for r, ids in zip(live, drafts, strict=True)
            ]
            reply, _ = verify.call(Verify(items=items), timeout_s=CALL_S, expect=VerifyReply)
            for r, res in zip(live, reply.results, strict=True):
                _commit(r, res)
            if after_verify is not None:
                after_verify(live)
    finally:
        ids = [r.rid for r in runs]
        verify.call(Release(request_ids=ids), timeout_s=CALL_S, expect=ReleaseReply)
        if draft is not None:
            draft.call(Release(request_ids=ids), timeout_s=CALL_S, expect=ReleaseReply)


def _commit(r: Run, res) -> None:
    assert res.error is None, res.error
    assert res.request_id == r.rid and res.commit_len == len(res.committed_ids)
    r.out.extend(res.committed_ids)
    r.last.extend(res.committed_ids)
    r.results.append(res)
    assert res.base_len == r.base_len
    if res.finished_reason is not None or len(r.out) >= r.max_tokens:
        r.finished = res.finished_reason or "length"
