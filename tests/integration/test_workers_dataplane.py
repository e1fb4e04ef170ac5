"""Data plane (verify -> draft Features), health probes and metrics of the worker services."""

from __future__ import annotations

import pytest
import torch

from splitflash.cli import serve_cmd
from splitflash.local import generate_local
from splitflash.protocol import (
    PeerTimeout,
    Prefill,
    PrefillItem,
    PrefillReply,
    ProtocolError,
    handshake,
    make_hello,
)
from splitflash.services.draft.config import DraftSettings
from splitflash.services.draft.ngram import NgramDrafter
from splitflash.services.draft.server import DraftServer
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine
from splitflash.services.verify.sampling import Sampling
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
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 9]


class FeatureRecordingDrafter(NgramDrafter):
    """n-gram drafts, plus the DFlash data-plane interface: records every feature block."""

    name = "fake-features"
    target_layer_ids = (0, 2)
    policy_string = "fake: no attention"

    def __init__(self) -> None:
        super().__init__()
        self.features: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def add_features(self, request_id: str, start_pos: int, features: torch.Tensor) -> None:
        have = sum(f.shape[0] for _, f in self.features.get(request_id, []))
        if start_pos != have:  # what a real drafter does: a gap is an error, never patched
            raise ValueError(f"features start at {start_pos}, drafter holds {have}")
        self.features.setdefault(request_id, []).append((start_pos, features.clone()))


@pytest.mark.parametrize("chunk", [8192, 4])
def test_features_reach_the_drafter_contiguously_before_each_reply(chunk):
    """chunk 4: a prompt prefilled in chunks streams each chunk's rows as it is made."""
    drafter = FeatureRecordingDrafter()
    with running(DraftServer(DraftSettings(bind=ANY_PORT, metrics_port=0), drafter)) as d:
        settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr=d.endpoint)
        engine = tiny_engine(tiny_model())
        engine.prefill_chunk = chunk
        with (
            running(VerifyServer(settings, engine=engine)) as v,
            client_for(v.endpoint, "verify") as vc,
            client_for(d.endpoint, "draft") as dc,
        ):
            runs = [Run("f0", PROMPT, max_tokens=20), Run("f1", PROMPT[:7], max_tokens=9)]

            def check_delivered(live):
                # Features were acked before the Verify reply: they are here already.
                for r in live:
                    rows = sum(f.shape[0] for _, f in drafter.features[r.rid])
                    assert rows == r.base_len - 1  # the KV holds all committed but the anchor

            gateway_generate(
                vc, dc, runs, block=4, draft_peer="draft", after_verify=check_delivered
            )
            assert v.engine.feature_layer_ids == (0, 2)  # set by the gateway's Hello
    hidden = engine.model.cfg.hidden_size
    for r in runs:
        blocks = drafter.features[r.rid]
        starts = [s for s, _ in blocks]
        sizes = [f.shape[0] for _, f in blocks]
        assert starts == [sum(sizes[:i]) for i in range(len(sizes))]  # contiguous from 0
        # prefill: the prompt's rows, a block per chunk; each verify step: the KV growth =
        # accepted + 1
        prompt_blocks = [min(chunk, len(r.prompt) - lo) for lo in range(0, len(r.prompt), chunk)]
        steps = [res.accepted_drafts + 1 for res in r.results[1:]]
        assert sizes == prompt_blocks + steps
        assert all(f.shape[1] == 2 * hidden for _, f in blocks)
    # The prompt's features are the target's own hidden states of layers 0 and 2.
    oracle = TargetEngine(tiny_model(), tiny_engine(tiny_model()).cache, (0, 2))
    ref = oracle.prefill("o", PROMPT, Sampling(), (), 100).features
    got = torch.cat([f for _, f in drafter.features["f0"]])[: len(PROMPT)]
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)


def test_features_link_down_never_fails_the_step():
    # Nothing listens at draft_addr: prefill still answers, the failure is counted.
    settings = VerifySettings(
        bind=ANY_PORT,
        metrics_port=0,
        draft_addr="tcp://127.0.0.1:9",
        features_timeout_s=0.2,
        heartbeat_timeout_s=0.2,
    )
    engine = tiny_engine(tiny_model())
    engine.feature_layer_ids = (1,)
    with (
        running(VerifyServer(settings, engine=engine)) as v,
        client_for(v.endpoint, "verify") as vc,
    ):
        items = [
            PrefillItem(request_id="a", deadline=deadline(), prompt_ids=PROMPT, draft_peer="draft")
        ]
        reply, _ = vc.call(Prefill(items=items), timeout_s=CALL_S, expect=PrefillReply)
        assert reply.results[0].error is None and reply.results[0].commit_len == 1
        failures = v.metrics.registry.get_sample_value(
            "splitflash_protocol_errors_total", {"service": "verify", "code": "features_handshake"}
        )
        assert failures == 1


def test_health_probe_names_the_service_and_fails_on_the_wrong_one(capsys):
    engine = tiny_engine(tiny_model())
    settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr="")
    with running(VerifyServer(settings, engine=engine)) as v:
        assert "verify at" in serve_cmd.probe("verify", v.endpoint, CALL_S)
        try:
            serve_cmd.probe("draft", v.endpoint, CALL_S)
        except ProtocolError as e:
            assert "'verify' service, not 'draft'" in str(e)
        else:
            raise AssertionError("probing verify as draft must fail")
    try:
        serve_cmd.probe("verify", "tcp://127.0.0.1:9", 0.2)
    except PeerTimeout:
        pass
    else:
        raise AssertionError("probing a closed port must time out")


def test_metrics_count_steps_kv_and_errors():
    with (
        running(DraftServer(DraftSettings(bind=ANY_PORT, metrics_port=0))) as d,
        running(
            VerifyServer(
                VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr=""),
                engine=tiny_engine(tiny_model()),
            )
        ) as v,
        client_for(v.endpoint, "verify") as vc,
        client_for(d.endpoint, "draft") as dc,
    ):
        run = Run("m", PROMPT, max_tokens=12)
        gateway_generate(vc, dc, [run], block=4)
        vc.sock.send_multipart([b"", b"c", b"junk"])
        assert vc.sock.poll(int(CALL_S * 1000))
        vc.sock.recv_multipart()
    vreg, dreg = v.metrics.registry, d.registry
    assert vreg.get_sample_value("splitflash_step_phase_seconds_count", {"phase": "verify"}) == len(
        run.results
    )
    assert vreg.get_sample_value("splitflash_kv_pages_total") == 64
    assert vreg.get_sample_value("splitflash_kv_pages_used") == 0
    assert (
        vreg.get_sample_value(
            "splitflash_protocol_errors_total", {"service": "verify", "code": "malformed"}
        )
        == 1
    )
    assert vreg.get_sample_value("splitflash_service_busy_seconds_total", {"service": "verify"}) > 0
    assert (
        dreg.get_sample_value("splitflash_draft_steps_total", {"context_bucket": "<=2k"})
        == len(run.results) - 1
    )


def test_dflash_drafter_over_services_is_lossless_and_batched():
    """The real DFlash proposer (tiny, random) behind the draft server: features flow verify ->
    draft, Propose drafts a batch in one forward, greedy output equals target-only."""
    pytest.importorskip("splitflash.training.recipe")
    from splitflash.models.dflash import DFlashDrafter
    from splitflash.services.draft.dflash_drafter import DFlashProposer
    from splitflash.training.recipe import drafter_config

    model = tiny_model()
    cfg = drafter_config(
        model.cfg,
        layers=2,
        window=4,
        block_size=6,
        target_layer_ids=(0, 2),
        mask_token_id=96,
        intermediate_size=64,
    )
    torch.manual_seed(0)
    proposer = DFlashProposer(DFlashDrafter(cfg, model.embed_tokens, model.lm_head.weight).eval())
    with running(DraftServer(DraftSettings(bind=ANY_PORT, metrics_port=0), proposer)) as d:
        settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr=d.endpoint)
        with (
            running(VerifyServer(settings, engine=tiny_engine(model, pages=128))) as v,
            client_for(v.endpoint, "verify") as vc,
            client_for(d.endpoint, "draft") as dc,
        ):
            runs = [Run("d0", PROMPT, max_tokens=20), Run("d1", PROMPT[:4], max_tokens=15)]
            gateway_generate(vc, dc, runs, block=6, draft_peer="draft")
            info = handshake(dc, make_hello("probe", "p"), timeout_s=CALL_S).info
            assert (info["cuda_graphs"], info["metrics_port"]) == ("off", "0")  # CPU
            assert v.metrics.registry.get_sample_value(
                "splitflash_protocol_errors_total",
                {"service": "verify", "code": "features_timeout"},
            ) in (None, 0.0)
    for r in runs:
        want = generate_local(tiny_engine(tiny_model()), None, r.prompt, r.max_tokens).token_ids
        assert r.out == want
        assert sum(res.draft_tokens for res in r.results[1:]) > 0
    assert not proposer.requests  # released
    keys = d.registry.get_sample_value(
        "splitflash_draft_kv_keys_read_total", {"layer_kind": "sliding", "context_bucket": "<=2k"}
    )
    assert keys is not None and keys > 0
    forwards = {m: d.registry.get_sample_value("splitflash_draft_forwards_total", {"mode": m})
                for m in ("graph", "eager")}  # fmt: skip
    assert forwards["graph"] == 0 and forwards["eager"] > 0  # CPU: no graphs, and it says so
    assert d.registry.get_sample_value("splitflash_draft_graph_capture_failed") == 0
    assert d.registry.get_sample_value("splitflash_draft_graph_captures_total") == 0
    assert d.registry.get_sample_value("splitflash_draft_graph_evictions_total") == 0
