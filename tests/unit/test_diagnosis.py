"""Doctor's anomaly rules on synthetic rows: the incident's own numbers must produce the
right findings, a healthy deployment none, and each fault exactly its own finding."""

import socket

import pytest

from splitflash.cli import doctor_cmd
from splitflash.diagnosis import Finding, PolicyInfo, diagnose, parse_policy
from splitflash.diagnosis.rows import parse_metrics, summarise, worker_figures
from splitflash.models.dflash import TORCH_ATTENTION, DFlashConfig
from splitflash.models.dflash.policy import build_policy, policy_string

INCIDENT_POLICY = "5 of 6 layers sliding (window 2048), 1 full; block non-causal; block_size 16"
KV_PER_TOKEN = 70_000  # bytes: 61 layers x 576 MLA values x bf16, DFLASH.md
WEIGHT_BYTES = 2e9  # assumed active weight bytes per step: only the ratio matters


def row(context, **kw):
    base = dict(context=context, steps=40, tok_s=100.0, step_ms=10.0, mean_commit_len=4.0,
                drafted=15.0, accepted_drafts=3.0, accepted_depth=3.0, draft_ms=1.0,
                verify_ms=8.0, transport_ms=0.5)  # fmt: skip
    return {**base, **kw}


def codes(findings):
    return sorted(f.code for f in findings)


def by_code(findings, code):
    (found,) = [f for f in findings if f.code == code]
    return found


def dflash_config(**kw):
    base = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, rms_norm_eps=1e-6,
                rope_theta=10000.0, vocab_size=97, target_layer_ids=(1, 2),
                mask_token_id=5, block_size=16,
                layer_types=("sliding_attention",) * 5 + ("full_attention",),
                sliding_window=2048)  # fmt: skip
    return DFlashConfig(**{**base, **kw})


# ---- the incident ------------------------------------------------------------------------
def incident_rows(with_bytes=False):
    rows = [
        row(1400, tok_s=118.6, step_ms=8.4, mean_commit_len=1.00, accepted_drafts=1.00,
            accepted_depth=3.00, draft_ms=1.2, verify_ms=6.5),
        row(185_000, tok_s=0.7, step_ms=1430.0, mean_commit_len=1.00, accepted_drafts=1.00,
            accepted_depth=3.00, draft_ms=1350.0, verify_ms=70.0),
    ]  # fmt: skip
    if with_bytes:
        for r in rows:
            r["bytes_per_step"] = WEIGHT_BYTES + KV_PER_TOKEN * r["context"]
    return rows


def test_incident_numbers_give_every_finding_of_the_incident():
    policy = parse_policy("dflash", INCIDENT_POLICY)
    found = diagnose(incident_rows(), policy)
    assert codes(found) == sorted(["commit_len_stuck", "metrics_contradict",
                                   "step_outgrows_bytes", "throughput_collapse",
                                   "window_not_applied"])  # fmt: skip
    assert all(f.severity == "critical" for f in found)
    assert (
        "mean commit_len 1.00 with 15 drafts per step" in by_code(found, "commit_len_stuck").message
    )
    contra = by_code(found, "metrics_contradict").message
    assert "accepted_depth 3.00 but accepted_drafts 1.00" in contra and "d == a" in contra
    window = by_code(found, "window_not_applied").message
    assert "draft time grows" in window and "5 of 6 drafter layers are sliding" in window
    assert "the sliding window is not applied" in window
    assert (
        "118.6 tok/s at 1.4k to 0.7 tok/s at 185k" in by_code(found, "throughput_collapse").message
    )
    assert "linear in context" in by_code(found, "step_outgrows_bytes").message


def test_incident_with_bytes_read_says_how_much_faster_than_the_bytes():
    found = diagnose(incident_rows(with_bytes=True), parse_policy("dflash", INCIDENT_POLICY))
    msg = by_code(found, "step_outgrows_bytes").message
    # 1430 / 8.4 = 170x step time for (2e9 + 13e9) / (2e9 + 98e6) = 7.1x bytes: 24x faster
    assert "step time grows 24x faster than the bytes read" in msg


def test_commit_len_contradicting_accepted_drafts_alone_is_named():
    found = diagnose([row(1000, mean_commit_len=2.0, accepted_drafts=2.0, accepted_depth=2.0)])
    assert codes(found) == ["metrics_contradict"]
    assert "c == a + 1" in found[0].message


# ---- healthy -----------------------------------------------------------------------------
def healthy_rows():
    return [
        row(1400, tok_s=120.0, step_ms=8.4, draft_ms=1.00, bytes_per_step=2.1e9,
            keys_per_draft={"sliding": 5 * 1400, "full": 1400}),
        row(8192, tok_s=110.0, step_ms=9.2, mean_commit_len=3.9, accepted_drafts=2.9,
            accepted_depth=2.9, draft_ms=1.05, bytes_per_step=2.6e9,
            keys_per_draft={"sliding": 5 * 2048, "full": 8192}),
        row(32768, tok_s=95.0, step_ms=10.8, mean_commit_len=3.8, accepted_drafts=2.8,
            accepted_depth=2.8, draft_ms=1.10, bytes_per_step=4.3e9,
            keys_per_draft={"sliding": 5 * 2048, "full": 32768}),
    ]  # fmt: skip


def test_healthy_rows_produce_no_finding():
    policy = parse_policy("dflash", INCIDENT_POLICY, mismatch=False, sliding_keys_bound=5 * 2048)
    assert diagnose(healthy_rows(), policy, {"kv_length": 0.0}) == []
    assert diagnose(healthy_rows()) == []  # nothing known of the drafter: still healthy


def test_truncated_last_step_is_not_a_contradiction():
    # 4 steps, the last cut short by max_tokens: c = (4+4+4+2)/4 = 3.5 with a = 3.0
    assert diagnose([row(900, steps=4, mean_commit_len=3.5)]) == []


def test_rows_with_too_few_steps_are_not_judged():
    assert diagnose([row(100, steps=2, mean_commit_len=1.0, accepted_depth=7.0)]) == []


# ---- injected faults ---------------------------------------------------------------------
def test_garbage_drafter_gives_commit_len_stuck_only():
    rows = [row(c, mean_commit_len=1.0, drafted=7.0, accepted_drafts=0.0, accepted_depth=0.0)
            for c in (200, 600)]  # fmt: skip
    found = diagnose(rows, PolicyInfo(drafter="garbage"))
    assert codes(found) == ["commit_len_stuck"]
    assert "every draft rejected, or drafter and target out of step" in found[0].message
    assert "garbage" in found[0].message


def test_window_off_is_named_from_policy_and_keys_read_without_time_growth():
    """Tiny drafter on a CPU: draft time flat, but the policy says 'window off' and the
    keys read per draft grow with context."""
    cfg = dflash_config(sliding_window=128)
    text = policy_string(cfg, build_policy(cfg, "off", TORCH_ATTENTION), "off")
    policy = parse_policy("dflash", text, mismatch=True, sliding_keys_bound=0.0)
    assert (policy.sliding_in_force, policy.sliding_in_checkpoint, policy.window) == (0, 5, 128)
    rows = [row(c, draft_ms=3.0, keys_per_draft={"full": 6.0 * c, "sliding": 0.0})
            for c in (200, 600, 1400)]  # fmt: skip
    found = diagnose(rows, policy)
    assert codes(found) == ["window_not_applied"]
    msg = found[0].message
    assert "5 of 6 drafter layers are sliding (window 128)" in msg and "window_override=off" in msg
    assert "keys read per draft grow 7.0x" in msg and "draft time" not in msg


def test_sliding_reads_over_the_bound_are_named_even_with_the_policy_in_force():
    policy = parse_policy("dflash", INCIDENT_POLICY, mismatch=False, sliding_keys_bound=10240)
    rows = healthy_rows()
    rows[2]["keys_per_draft"] = {"sliding": 5 * 32768, "full": 32768}
    found = diagnose(rows, policy)
    assert codes(found) == ["window_not_applied"]
    assert "read 163840 keys per draft at 33k, more than their windows allow" in found[0].message


def test_invariant_violations_are_counted_in_words():
    found = diagnose(healthy_rows(), violations={"kv_length": 2.0, "commit_len": 1.0})
    assert codes(found) == ["invariant_violations"]
    assert found[0].message.startswith(
        "invariant violations counted: 3 (commit_len 1, kv_length 2)"
    )


def test_acceptance_falling_with_context_is_named():
    rows = [
        row(1000, mean_commit_len=4.53, accepted_drafts=3.53, accepted_depth=3.53),
        row(32000, mean_commit_len=2.09, accepted_drafts=1.09, accepted_depth=1.09),
    ]
    found = diagnose(rows)
    assert codes(found) == ["acceptance_falls"]
    assert "from 4.53 at 1k to 2.09 at 32k" in found[0].message


def test_model_drafter_that_proposes_nothing_is_named_but_ngram_is_not():
    rows = [row(500, drafted=0.5, accepted_drafts=0.2, accepted_depth=0.2, mean_commit_len=1.2,
                no_draft_fraction=0.9)]  # fmt: skip
    assert codes(diagnose(rows, PolicyInfo(drafter="dflash"))) == ["drafter_silent"]
    assert diagnose(rows, PolicyInfo(drafter="ngram")) == []


def test_trace_and_response_stats_disagreeing_is_named():
    r = row(700, trace_totals={"steps": 40, "draft_tokens": 600, "accepted_drafts": 120},
            reported={"steps": 40, "draft_tokens": 640, "accepted_drafts": 120})  # fmt: skip
    found = diagnose([r])
    assert codes(found) == ["stats_disagree"] and "draft_tokens 600 vs 640" in found[0].message


def test_finding_severity_is_checked():
    with pytest.raises(ValueError):
        Finding("x", "y", "fatal")


# ---- rows from raw observations ----------------------------------------------------------
def step(c, k, a, draft=1.0, verify=5.0):
    return dict(context=0, drafted=k, accepted_depth=a, accepted_drafts=a, commit_len=c,
                draft_ms=draft, verify_ms=verify, transport_ms=0.5)  # fmt: skip


def test_summarise_pools_steps_over_requests():
    reqs = [
        dict(context=100, tokens=9, decode_s=0.4, reported={"steps": 2, "draft_tokens": 8,
             "accepted_drafts": 6}, trace=[step(4, 4, 3), step(4, 4, 3)]),
        dict(context=102, tokens=3, decode_s=0.2, reported={"steps": 2, "draft_tokens": 4,
             "accepted_drafts": 0}, trace=[step(1, 4, 0, draft=3.0), step(1, 0, 0)]),
    ]  # fmt: skip
    r = summarise(reqs)
    assert (r["context"], r["steps"], r["requests"]) == (101, 4, 2)
    assert r["mean_commit_len"] == pytest.approx(10 / 4)  # pooled, not mean of 4.0 and 1.0
    assert r["drafted"] == pytest.approx(3.0) and r["accepted_drafts"] == pytest.approx(1.5)
    # step time: the faster request's (100 ms, not the pooled 150): a stall is not judged
    assert r["tok_s"] == pytest.approx((12 - 2) / 0.6) and r["step_ms"] == pytest.approx(100.0)
    # draft time likewise: the faster request's mean (1.0, not the pooled 1.5)
    assert r["draft_ms"] == pytest.approx(1.0) and r["no_draft_fraction"] == pytest.approx(0.25)
    assert r["trace_totals"] == {"steps": 4, "draft_tokens": 12, "accepted_drafts": 6}
    assert r["reported"] == r["trace_totals"]
    assert "queue_ms" not in r  # these traces (an older gateway's) do not measure it


def test_summarise_takes_the_queue_time_when_every_step_has_it():
    queued = [dict(step(4, 4, 3), queue_ms=q) for q in (30.0, 10.0)]
    reqs = [
        dict(context=100, tokens=9, decode_s=0.4, trace=queued),
        dict(context=100, tokens=9, decode_s=0.4, trace=[dict(step(4, 4, 3), queue_ms=4.0)]),
    ]
    assert summarise(reqs)["queue_ms"] == pytest.approx(4.0)  # the faster request's mean
    reqs[1]["trace"].append(step(4, 4, 3))  # one step without it: not measured
    assert "queue_ms" not in summarise(reqs)


def test_worker_figures_from_scrape_deltas():
    def scrape(steps, sliding, full, read):
        keys = "splitflash_draft_kv_keys_read_total"
        return parse_metrics(
            "# TYPE splitflash_draft_steps_total counter\n"
            f'splitflash_draft_steps_total{{context_bucket="<=2k"}} {steps}\n'
            "# TYPE splitflash_draft_kv_keys_read_total counter\n"
            f'{keys}{{layer_kind="sliding",context_bucket="<=2k"}} {sliding}\n'
            f'{keys}{{layer_kind="full",context_bucket="<=2k"}} {full}\n'
            "# TYPE splitflash_verify_kv_bytes_read_total counter\n"
            f'splitflash_verify_kv_bytes_read_total{{context_bucket="<=2k"}} {read}\n'
        )  # fmt: skip

    before, after = scrape(10, 100, 50, 1e6), scrape(30, 100, 2050, 5e6)
    got = worker_figures((before, after), (before, after), steps=20)
    assert got == {"keys_per_draft": {"full": 100.0, "sliding": 0.0}, "bytes_per_step": 2e5}


def test_doctor_exits_2_with_a_clear_message_when_the_gateway_is_unreachable(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nobody listens there
    assert doctor_cmd.main(["--url", f"http://127.0.0.1:{port}", "--contexts", "100"]) == 2
    assert f"gateway unreachable at http://127.0.0.1:{port}" in capsys.readouterr().err


def test_a_paused_drafter_is_named_as_paused_and_its_stuck_commits_still_show():
    """The gateway's speculation gate ran 90% of the steps without drafts: not a silent
    drafter, and the drafted steps' own commit_len (1.00 with 15 drafts) is still judged,
    where the mean over all steps (1.5 drafts per step) would hide it."""
    paused = row(185_000, drafted=1.5, accepted_drafts=0.0, accepted_depth=0.0,
                 mean_commit_len=1.0, no_draft_fraction=0.9, paused_fraction=0.9,
                 drafting_commit_len=1.0, drafting_drafted=15.0)  # fmt: skip
    found = diagnose([paused], PolicyInfo(drafter="dflash"))
    assert codes(found) == ["commit_len_stuck", "speculation_paused"]
    msg = by_code(found, "speculation_paused").message
    assert "paused drafting on 90% of the steps at 185k" in msg and "1.00 tokens" in msg
    assert "15 drafts per step (steps that drafted" in by_code(found, "commit_len_stuck").message
    # the same row with the pauses not the gate's: the drafter itself fell silent
    silent = dict(paused, paused_fraction=0.0)
    assert "drafter_silent" in codes(diagnose([silent], PolicyInfo(drafter="dflash")))


def test_summarise_keeps_the_drafting_steps_apart():
    reqs = [dict(context=100, tokens=6, decode_s=0.3, reported={},
                 trace=[step(1, 0, 0), step(4, 6, 3), step(1, 0, 0), step(2, 4, 1)])]  # fmt: skip
    r = summarise(reqs)
    assert r["drafting_commit_len"] == pytest.approx(3.0)  # (4 + 2) / 2 drafting steps
    assert r["drafting_drafted"] == pytest.approx(5.0)
    assert r["mean_commit_len"] == pytest.approx(2.0) and r["no_draft_fraction"] == 0.5
    assert "drafting_commit_len" not in summarise([dict(reqs[0], trace=[step(1, 0, 0)])])


# ---- how the worker steps ran --------------------------------------------------------------
def graphed(context, verify_eager=0.0, draft_eager=0.0, **kw):
    figures = dict(verify_eager_fraction=verify_eager, draft_eager_fraction=draft_eager,
                   verify_graph_failed=0.0, draft_graph_failed=0.0)  # fmt: skip
    return row(context, **{**figures, **kw})


def test_eager_steps_at_one_context_of_a_graphed_deployment_are_named():
    rows = [graphed(1000), graphed(8000, draft_eager=0.95), graphed(64000, draft_eager=1.0)]
    found = by_code(diagnose(rows), "steps_not_graphed")
    assert codes(diagnose(rows)) == ["steps_not_graphed"]
    assert "draft ran its forwards eagerly (95% at 8k, 100% at 64k)" in found.message
    assert "pool_context" in found.message  # the draft's own likely causes
    rows = [graphed(1000, verify_eager=0.75), graphed(8000)]
    assert "verify ran its forwards eagerly (75% at 1k)" in diagnose(rows)[0].message
    # a few eager steps (a prompt outside the pool, a batch past the largest graph): fine
    assert diagnose([graphed(1000), graphed(8000, verify_eager=0.5)]) == []


def test_all_eager_everywhere_is_a_cpu_deployment_not_a_finding():
    assert diagnose([graphed(c, verify_eager=1.0, draft_eager=1.0) for c in (500, 4000)]) == []


def test_a_failed_capture_is_named_from_its_gauge():
    rows = [graphed(1000), graphed(8000, draft_graph_failed=1.0, draft_eager=0.3)]
    found = diagnose(rows)
    assert codes(found) == ["graph_capture_failed"]
    assert "in draft (splitflash_draft_graph_capture_failed = 1)" in found[0].message


def test_graph_figures_from_scrape_deltas():
    def scrape(graph, eager, captures, seconds, failed):
        name = "splitflash_verify_forwards_total"
        return parse_metrics(
            f"# TYPE {name} counter\n"
            f'{name}{{mode="graph"}} {graph}\n{name}{{mode="eager"}} {eager}\n'
            "# TYPE splitflash_verify_graph_captures_total counter\n"
            f"splitflash_verify_graph_captures_total {captures}\n"
            "# TYPE splitflash_verify_graph_capture_seconds_total counter\n"
            f"splitflash_verify_graph_capture_seconds_total {seconds}\n"
            "# TYPE splitflash_verify_graph_capture_failed gauge\n"
            f"splitflash_verify_graph_capture_failed {failed}\n"
            "# TYPE splitflash_verify_graph_evictions_total counter\n"
            f"splitflash_verify_graph_evictions_total {captures // 4}\n"
        )  # fmt: skip

    before, after = scrape(10, 5, 3, 0.5, 0), scrape(37, 8, 5, 0.6, 1)
    got = worker_figures(None, (before, after), steps=30)
    want = {"verify_eager_fraction": 0.1, "verify_graph_captures": 2.0,
            "verify_capture_ms": 100.0, "verify_graph_evictions": 1.0,
            "verify_graph_failed": 1.0}  # fmt: skip
    assert got == pytest.approx(want)
    assert worker_figures(None, (before, before), steps=30) == {}  # no forward: not measured


def test_the_table_shows_eager_shares_where_measured_and_a_dash_where_not():
    from rich.console import Console

    from splitflash.diagnosis.doctor import DoctorReport

    rows = [graphed(1000, verify_eager=0.25), row(8000)]
    rows[0].pop("draft_eager_fraction")
    console = Console(record=True, width=250)
    info = {"device": "cuda:0", "cuda_graphs": "off", "other": "x"}
    doctor_cmd.print_report(DoctorReport("u", "m", PolicyInfo(), rows=rows, verify_info=info),
                            console)  # fmt: skip
    assert "verify: device cuda:0; cuda_graphs off\n" in console.export_text(clear=False)
    lines = [ln for ln in console.export_text().splitlines() if "1000" in ln or "8000" in ln]
    cells = [[c.strip() for c in ln.strip("│ ").split("│")] for ln in lines]
    assert cells[0][-2:] == ["25%", "-"] and cells[1][-2:] == ["-", "-"]


def test_graphs_dropped_during_the_probe_say_the_lru_is_too_small():
    rows = [
        graphed(1000, verify_graph_evictions=0.0),
        graphed(8000, verify_graph_evictions=2.0, draft_graph_evictions=1.0),
    ]
    (found,) = diagnose(rows)
    assert found.code == "graph_lru_too_small"
    assert "(verify 2 and draft 1)" in found.message and "GRAPH_MAX_HELD" in found.message
    assert diagnose([graphed(1000, verify_graph_evictions=0.0)]) == []


def test_worker_metrics_urls_come_from_ready_where_one_worker_announces_a_port():
    from splitflash.diagnosis.probe import metrics_url

    def ready(*workers):
        return {"verify": {"workers": [{"addr": a, "info": {"metrics_port": p}}
                                       for a, p in workers]}}  # fmt: skip

    assert metrics_url(ready(("tcp://127.0.0.1:5555", "9102")), "verify") == (
        "http://127.0.0.1:9102/metrics", "")  # fmt: skip
    assert metrics_url(ready(("tcp://verify:5555", "9102")), "verify")[0] == (
        "http://verify:9102/metrics")  # fmt: skip
    assert metrics_url(ready(("tcp://[::1]:5555", "9102")), "verify")[0] == (
        "http://[::1]:9102/metrics")  # fmt: skip
    two = ready(("tcp://a:5555", "9102"), ("tcp://b:5555", "9102"))
    assert metrics_url(two, "verify") == (None, "2 verify workers behind the gateway")
    assert metrics_url(ready(("tcp://a:5555", "0")), "verify")[0] is None  # metrics off
    assert metrics_url(ready(("tcp://a:5555", "")), "verify")[0] is None  # an older worker
    assert metrics_url(ready(), "draft") == (None, "0 draft workers behind the gateway")


def test_unreachable_or_unknown_worker_metrics_leave_a_note_naming_the_option():
    from splitflash.diagnosis.doctor import _discover

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nobody listens there
    ready = {"verify": {"workers": [{"addr": "tcp://127.0.0.1:5555",
                                     "info": {"metrics_port": str(port)}}]},
             "draft": {"workers": []}, "gateway": None}  # fmt: skip
    notes: list[str] = []
    assert _discover(ready, "verify", notes) is None and _discover(ready, "draft", notes) is None
    assert _discover(ready, "gateway", notes) is None  # no such service: no note
    assert notes == [
        f"verify worker metrics not read (verify metrics at http://127.0.0.1:{port}/metrics "
        "do not answer): pass --verify-metrics URL",
        "draft worker metrics not read (0 draft workers behind the gateway): pass "
        "--draft-metrics URL",
    ]


def test_steps_queued_behind_other_work_are_named():
    """queue_ms over 30% of the step (the alert's threshold): the step times include
    waiting for other requests' prompt chunks; at 20% nothing is said."""
    busy = row(32_000, step_ms=50.0, queue_ms=20.0)
    found = diagnose([row(1400, queue_ms=0.1), busy], PolicyInfo(drafter="dflash"))
    assert codes(found) == ["steps_queued"]
    msg = by_code(found, "steps_queued").message
    assert "steps at 32k waited 20.0 ms of their 50.0 ms" in msg
    assert "SPLITFLASH_VERIFY_PREFILL_CHUNK_MS" in msg
    assert diagnose([row(32_000, step_ms=50.0, queue_ms=10.0)], PolicyInfo(drafter="dflash")) == []
