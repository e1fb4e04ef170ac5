"""Verify + draft services over real tcp sockets (servers in threads, tiny random models),
driven with the protocol Client exactly as the gateway drives them."""

from __future__ import annotations

import time

import pytest
import zmq

from splitflash.local import generate_local
from splitflash.models.graphs import VerifyGraphs
from splitflash.models.kv_cache import PagedKVCache
from splitflash.protocol import (
    PROTOCOL_VERSION,
    Error,
    ErrorCode,
    Heartbeat,
    HeartbeatReply,
    Hello,
    Open,
    OpenReply,
    Prefill,
    PrefillItem,
    PrefillReply,
    Propose,
    ProposeItem,
    ProposeReply,
    ProtocolError,
    ProtocolMismatch,
    Release,
    ReleaseReply,
    Verify,
    VerifyItem,
    VerifyReply,
    check_hello_reply,
    handshake,
    make_hello,
)
from splitflash.services.draft.config import DraftSettings
from splitflash.services.draft.server import DraftServer
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine
from splitflash.services.verify.server import VerifyServer
from tests.conftest import tiny_engine, tiny_model
from tests.integration.workers_harness import (
    CALL_S,
    Run,
    client_for,
    deadline,
    gateway_generate,
    running,
)

ANY_PORT = "tcp://127.0.0.1:*"
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13, 11, 12, 13, 11, 12, 40, 41, 42]]


def verify_server(pages: int = 64, **overrides) -> VerifyServer:
    settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr="", **overrides)
    return VerifyServer(settings, engine=tiny_engine(tiny_model(), pages=pages), model_name="tiny")


def draft_server(drafter=None, **overrides) -> DraftServer:
    return DraftServer(DraftSettings(bind=ANY_PORT, metrics_port=0, **overrides), drafter)


def target_only(prompt: list[int], max_tokens: int) -> list[int]:
    return generate_local(tiny_engine(tiny_model()), None, prompt, max_tokens).token_ids


def test_greedy_over_services_equals_target_only_and_release_frees_everything():
    with (
        running(verify_server()) as v,
        running(draft_server()) as d,
        client_for(v.endpoint, "verify") as vc,
        client_for(d.endpoint, "draft") as dc,
    ):
        runs = [Run(f"r{i}", p, max_tokens=24) for i, p in enumerate(PROMPTS)]
        gateway_generate(vc, dc, runs, block=4)
        for r in runs:
            assert r.out == target_only(r.prompt, 24), r.rid
            assert r.finished == "length" and len(r.out) == 24
        steps = [res for r in runs for res in r.results[1:]]
        assert sum(res.draft_tokens for res in steps) > 0  # the drafter did draft
        assert all(
            res.commit_len == res.accepted_drafts + 1 or res.finished_reason for res in steps
        )
        # Release freed every KV page and all per-request state on both sides.
        assert v.engine.cache.used_pages == 0 and not v.engine.seqs
        assert not d.requests
        again, _ = vc.call(Release(request_ids=["r0", "r1"]), timeout_s=CALL_S, expect=ReleaseReply)
        assert again.released == []  # idempotent


def test_target_only_steps_without_a_drafter():
    with running(verify_server()) as v, client_for(v.endpoint, "verify") as vc:
        run = Run("solo", PROMPTS[0], max_tokens=10)
        gateway_generate(vc, None, [run])
        assert run.out == target_only(PROMPTS[0], 10)
        info = handshake(vc, make_hello("probe", "p"), timeout_s=CALL_S).info
        assert (info["device"], info["cuda_graphs"], info["graph_max_batch"]) == ("cpu", "off", "0")


@pytest.mark.parametrize("service", ["verify", "draft"])
def test_malformed_frame_gets_error_and_service_keeps_serving(service):
    server = verify_server() if service == "verify" else draft_server()
    with running(server), client_for(server.endpoint, service) as c:
        c.sock.send_multipart([b"", b"call-1", b"\xc1 not msgpack"])
        assert c.sock.poll(int(CALL_S * 1000), zmq.POLLIN)
        _empty, call_id, payload = c.sock.recv_multipart()
        err = c.responses.decode(payload)
        assert call_id == b"call-1" and isinstance(err, Error)
        assert err.code == ErrorCode.MALFORMED
        reply, _ = c.call(
            Heartbeat(seq=7, sent_at=time.time()), timeout_s=CALL_S, expect=HeartbeatReply
        )
        assert reply.seq == 7
        hello = handshake(c, make_hello("gateway", "gw"), timeout_s=CALL_S)
        assert hello.service == service


@pytest.mark.parametrize("service", ["verify", "draft"])
def test_protocol_version_mismatch_is_refused(service):
    server = verify_server() if service == "verify" else draft_server()
    with running(server), client_for(server.endpoint, service) as c:
        bad = Hello(protocol_version=PROTOCOL_VERSION + 1, service="gateway", peer_id="gw")
        reply, _ = c.call(bad, timeout_s=CALL_S)
        assert isinstance(reply, Error) and reply.code == ErrorCode.PROTOCOL_VERSION
        with pytest.raises(ProtocolMismatch, match="version"):
            check_hello_reply(reply)


def test_desync_deadline_and_unknown_are_per_item_errors():
    with (
        running(verify_server()) as v,
        running(draft_server()) as d,
        client_for(v.endpoint, "verify") as vc,
        client_for(d.endpoint, "draft") as dc,
    ):
        items = [
            PrefillItem(request_id=rid, deadline=deadline(), prompt_ids=PROMPTS[0])
            for rid in ("a", "b")
        ]
        pre, _ = vc.call(Prefill(items=items), timeout_s=CALL_S, expect=PrefillReply)
        base = pre.results[0].base_len
        assert base == len(PROMPTS[0]) + 1
        steps = [
            VerifyItem(
                request_id="a",
                deadline=deadline(),
                base_len=base + 3,
                draft_ids=[1, 2],
                max_commit=5,
            ),
            VerifyItem(
                request_id="b", deadline=deadline(), base_len=base, draft_ids=[1, 2], max_commit=5
            ),
            VerifyItem(
                request_id="zzz", deadline=deadline(), base_len=base, draft_ids=[], max_commit=5
            ),
            VerifyItem(
                request_id="a", deadline=time.time() - 1, base_len=base, draft_ids=[], max_commit=5
            ),
        ]
        reply, _ = vc.call(Verify(items=steps), timeout_s=CALL_S, expect=VerifyReply)
        desync, ok, unknown, late = reply.results
        assert desync.error.startswith("desync") and f"base_len {base + 3}" in desync.error
        assert desync.base_len == base  # verify's own committed length, for the log
        assert ok.error is None and ok.base_len == base + ok.commit_len
        assert unknown.error.startswith("unknown_request")
        assert late.error.startswith("deadline")

        opened, _ = dc.call(
            Open(request_id="a", deadline=deadline(), prompt_ids=PROMPTS[0], block_size=4),
            timeout_s=CALL_S,
            expect=OpenReply,
        )
        assert opened.base_len == len(PROMPTS[0])
        props = [
            ProposeItem(
                request_id="a",
                deadline=deadline(),
                base_len=opened.base_len + 2,
                last_ids=[1],
                max_drafts=3,
            ),
            ProposeItem(
                request_id="a",
                deadline=deadline(),
                base_len=opened.base_len + 1,
                last_ids=[5],
                max_drafts=3,
            ),
            ProposeItem(
                request_id="nope", deadline=deadline(), base_len=3, last_ids=[], max_drafts=3
            ),
            ProposeItem(
                request_id="a", deadline=time.time() - 1, base_len=3, last_ids=[], max_drafts=3
            ),
        ]
        drafts, _ = dc.call(Propose(items=props), timeout_s=CALL_S, expect=ProposeReply)
        bad, good, unknown, late = drafts.drafts
        assert bad.error.startswith("desync") and bad.base_len == opened.base_len
        assert good.error is None and good.base_len == opened.base_len + 1
        assert 0 < len(good.token_ids) <= 3  # block 4 -> at most 3 drafts
        assert unknown.error.startswith("unknown_request")
        assert late.error.startswith("deadline")
        vc.call(Release(request_ids=["a", "b"]), timeout_s=CALL_S, expect=ReleaseReply)
        assert v.engine.cache.used_pages == 0


def test_prefill_failures_stay_in_their_item():
    with running(verify_server(pages=8)) as v, client_for(v.endpoint, "verify") as vc:
        items = [
            PrefillItem(request_id="long", deadline=deadline(), prompt_ids=[1] * 600),
            PrefillItem(request_id="fits", deadline=deadline(), prompt_ids=[1] * 20),
            PrefillItem(request_id="full", deadline=deadline(), prompt_ids=[2] * 20),
            PrefillItem(request_id="fits", deadline=deadline(), prompt_ids=[3]),
            PrefillItem(request_id="late", deadline=time.time() - 1, prompt_ids=[3]),
            PrefillItem(request_id="peer", deadline=deadline(), prompt_ids=[3], draft_peer="draft"),
        ]
        reply, _ = vc.call(Prefill(items=items), timeout_s=CALL_S, expect=PrefillReply)
        long, fits, full, dup, late, peer = reply.results
        assert "exceeds context" in long.error
        assert fits.error is None and fits.commit_len == 1 and fits.base_len == 21
        assert "KVPoolFullError" in full.error  # 8 pages x 4 tokens: the first took 5
        assert "already exists" in dup.error
        assert late.error.startswith("deadline")
        assert "unknown draft_peer" in peer.error  # this verify has no draft link
        vc.call(Release(request_ids=["fits"]), timeout_s=CALL_S, expect=ReleaseReply)
        assert v.engine.cache.used_pages == 0 and not v.engine.seqs


def test_oversized_batch_and_wrong_socket_message_are_refused():
    with running(verify_server(max_batch=1)) as v, client_for(v.endpoint, "verify") as vc:
        items = [
            PrefillItem(request_id=f"x{i}", deadline=deadline(), prompt_ids=[1]) for i in range(2)
        ]
        reply, _ = vc.call(Prefill(items=items), timeout_s=CALL_S)
        assert isinstance(reply, Error) and "max_batch" in reply.message
        assert not v.engine.seqs
        with pytest.raises(ProtocolError):  # Open belongs to the draft socket's union
            vc.call(
                Open(request_id="a", deadline=deadline(), prompt_ids=[1], block_size=2),
                timeout_s=CALL_S,
            )


def test_batch_invariant_gauge_is_one_only_where_the_mode_is_in_force():
    """The setting on a CPU engine changes nothing (the torch references run either way), so
    the gauge an operator reads stays 0; on CUDA it is 1 (set from the same rule)."""
    engine = tiny_engine(tiny_model())
    engine.model.batch_invariant = True
    settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr="", batch_invariant=True)
    with running(VerifyServer(settings, engine=engine, model_name="tiny")) as v:
        value = v.metrics.registry.get_sample_value("splitflash_verify_batch_invariant")
        assert value == 0.0
    v.metrics.set_batch_invariant(True)
    assert v.metrics.registry.get_sample_value("splitflash_verify_batch_invariant") == 1.0


@pytest.mark.parametrize("warmup", [True, False])
def test_a_gateways_new_feature_layers_are_warmed_up_between_messages(warmup):
    """The start-up warm-up captured graphs without feature layers; a gateway Hello asking
    for layers queues the warm-up again for them, run while no message waits. Its captures
    are not counted as serving's, and a health check's Hello starts nothing."""
    model = tiny_model()
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 160, 4, cfg.num_kv_heads, cfg.head_dim, scratch_pages=16)
    engine = TargetEngine(model, cache, graphs=VerifyGraphs(model, cache, (1, 2), capture=False))
    settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr="", warmup=warmup)
    with running(VerifyServer(settings, engine=engine)) as v, client_for(v.endpoint, "verify") as c:
        info = handshake(c, make_hello("probe", "p", [1]), timeout_s=CALL_S).info
        assert info["cuda_graphs"] == "batch sizes 1,2, 48 kept" and info["graph_max_batch"] == "2"
        assert info["metrics_port"] == "0"
        time.sleep(0.5)  # a few idle polls
        assert engine.graphs.captures == 0 and engine.feature_layer_ids == ()
        handshake(c, make_hello("gateway", "gw", [1]), timeout_s=CALL_S)
        end = time.monotonic() + CALL_S  # queued before the reply; bounded wait for its end
        while v._idle_warmup is not None and time.monotonic() < end:
            time.sleep(0.05)
        # 640 tokens of pool: context 300 at blocks 1, 8 and 16 (3000 and 20000 do not fit).
        want = {(1, 1, 512, (1,)), (1, 8, 512, (1,)), (1, 16, 512, (1,))} if warmup else set()
        assert set(engine.graphs._graphs) == want
        captures = v.metrics.registry.get_sample_value("splitflash_verify_graph_captures_total")
        assert captures == 0.0 and engine.cache.free_pages == 160
