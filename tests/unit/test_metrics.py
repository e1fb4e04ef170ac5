"""Metric math (pooled, never averages of averages) and the per-service registries."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

from splitflash.services.common import metrics as m
from splitflash.services.common.metric_math import (
    CONTEXT_BUCKETS,
    INVARIANTS,
    METRICS,
    PREFIX,
    context_bucket,
    series_labels,
)
from splitflash.services.common.spec_totals import (
    SpecTotals,
    acceptance_rate,
    mean_commit_len,
    per_position_acceptance,
    pool,
)

# (K, max_depth, a, c) per request-step
REQUEST_A = [(15, 15, 6, 7)]  # one long accepted run
REQUEST_B = [(15, 15, 0, 1)] * 9  # nine steps, nothing accepted


def totals(steps: list[tuple[int, int, int, int]]) -> SpecTotals:
    t = SpecTotals()
    for step in steps:
        t = t.add(*step)
    return t


@pytest.mark.parametrize(
    ("n", "bucket"),
    [
        (0, "<=2k"),
        (2048, "<=2k"),
        (2049, "<=8k"),
        (8192, "<=8k"),
        (8193, "<=32k"),
        (32768, "<=32k"),
        (32769, "<=128k"),
        (131072, "<=128k"),
        (131073, ">128k"),
        (185_000, ">128k"),
    ],
)
def test_context_bucket_edges(n: int, bucket: str) -> None:
    assert context_bucket(n) == bucket
    assert bucket in CONTEXT_BUCKETS


def test_context_bucket_rejects_negative() -> None:
    with pytest.raises(ValueError):
        context_bucket(-1)


def test_pooled_math_by_hand() -> None:
    # chain K=4 accepts 2; chain K=4 accepts 0; tree of 3 nodes, depth 2, accepts 2;
    # a plain step without drafts (drafter down) still commits its one token.
    t = totals([(4, 4, 2, 3), (4, 4, 0, 1), (3, 2, 2, 3), (0, 0, 0, 1)])
    assert (t.steps, t.draft_tokens, t.accepted_drafts, t.committed_tokens) == (4, 11, 4, 8)
    assert mean_commit_len(t) == 8 / 4
    assert acceptance_rate(t) == 4 / 11
    assert t.drafted_per_pos == (3, 3, 2, 2)
    assert t.accepted_per_pos == (2, 2)
    assert per_position_acceptance(t) == (2 / 3, 2 / 3, 0.0, 0.0)


def test_pooling_differs_from_averaging_per_request_means() -> None:
    a, b = totals(REQUEST_A), totals(REQUEST_B)
    pooled = pool([a, b])
    assert mean_commit_len(pooled) == pytest.approx((7 + 9 * 1) / 10)  # 1.6
    assert acceptance_rate(pooled) == pytest.approx(6 / 150)  # 0.04
    # the wrong way: the mean of per-request means says 4.0 and 0.2
    assert (mean_commit_len(a) + mean_commit_len(b)) / 2 == pytest.approx(4.0)
    assert (acceptance_rate(a) + acceptance_rate(b)) / 2 == pytest.approx(0.2)
    # pooling two requests' totals is the same as counting all their steps together
    assert pooled == totals(REQUEST_A + REQUEST_B)
    assert pool([b, a]) == pooled


def test_empty_totals_are_zero_not_nan() -> None:
    t = SpecTotals()
    assert (mean_commit_len(t), acceptance_rate(t), per_position_acceptance(t)) == (0, 0, ())
    only_plain = totals([(0, 0, 0, 1)] * 3)
    assert mean_commit_len(only_plain) == 1.0 and acceptance_rate(only_plain) == 0.0


def test_response_stats_agree_with_the_pooled_math() -> None:
    """services/common/spec_stats.py (the response) computes what the dashboards compute."""
    spec_stats = pytest.importorskip("splitflash.services.common.spec_stats")
    steps = REQUEST_A + REQUEST_B + [(4, 4, 2, 3), (3, 2, 2, 3), (0, 0, 0, 1), (4, 4, 3, 2)]
    stats = spec_stats.SpecStats()
    for k, depth, a, c in steps:
        stats.record(k, depth, a, c)
    t = totals(steps)
    got = stats.to_dict()
    assert (got["steps"], got["draft_tokens"], got["accepted_drafts"]) == (
        t.steps,
        t.draft_tokens,
        t.accepted_drafts,
    )
    assert got["mean_commit_len"] == pytest.approx(mean_commit_len(t), abs=1e-6)
    assert got["acceptance_rate"] == pytest.approx(acceptance_rate(t), abs=1e-6)
    assert got["accepted_per_position"] == pytest.approx(per_position_acceptance(t), abs=1e-6)


def build_all() -> tuple[CollectorRegistry, ...]:
    regs = (CollectorRegistry(), CollectorRegistry(), CollectorRegistry())
    m.gateway_metrics(regs[0]), m.draft_metrics(regs[1]), m.verify_metrics(regs[2])
    return regs


def test_registries_export_the_catalogue_and_nothing_global() -> None:
    first, second = build_all(), build_all()  # two processes' worth in one: no clash
    exported = set().union(*(m.registry_series_names(r) for r in first))
    assert exported == set(series_labels())
    assert exported == set().union(*(m.registry_series_names(r) for r in second))
    assert all(n.startswith(PREFIX) for n in exported)
    assert not [n for n in m.registry_series_names(REGISTRY) if n.startswith(PREFIX)]
    for name, d in METRICS.items():
        assert d.doc and name == name.lower()
        if d.kind == "histogram":
            assert name.endswith(("_seconds", "_len")), f"{name}: unit missing from name"


def test_buckets_cover_the_design_ranges() -> None:
    assert m.METRICS["spec_commit_len"].buckets == tuple(float(i) for i in range(1, 18))
    for name in ("step_seconds", "step_phase_seconds", "step_phase_by_context_seconds"):
        b = m.METRICS[name].buckets
        assert b[0] == 1e-4 and b[-1] == 10 and list(b) == sorted(b)


def test_record_spec_step_counts_what_spec_totals_pools() -> None:
    reg = CollectorRegistry()
    g = m.gateway_metrics(reg)
    steps = [(4, 4, 2, 3), (4, 4, 0, 1), (3, 2, 2, 3), (0, 0, 0, 1), (4, 4, 4, 2)]
    for k, depth, a, c in steps:
        m.record_spec_step(g.spec, "<=8k", k, depth, a, c)
    t = totals(steps)

    def val(name: str, **labels: str) -> float:
        return reg.get_sample_value(PREFIX + name, labels) or 0.0

    bucket = {"context_bucket": "<=8k"}
    assert val("spec_verify_steps_total", **bucket) == t.steps
    assert val("spec_draft_tokens_total", **bucket) == t.draft_tokens
    assert val("spec_accepted_tokens_total", **bucket) == t.accepted_drafts
    assert val("spec_commit_len_sum") == t.committed_tokens
    assert val("spec_commit_len_count") == t.steps
    assert val("spec_commit_len_bucket", le="1.0") == 2  # the two c == 1 steps
    assert val("spec_truncated_steps_total") == 1  # (4, 4, 4, 2): finished inside the step
    for i, n in enumerate(t.accepted_per_pos):
        assert val("spec_accepted_tokens_per_pos_total", position=str(i)) == n
    for i, n in enumerate(t.drafted_per_pos):
        assert val("spec_drafted_per_pos_total", position=str(i)) == n


def test_invariant_and_fallback_series_exist_before_first_increment() -> None:
    reg = CollectorRegistry()
    g = m.gateway_metrics(reg)
    for name in INVARIANTS:  # increase() in an alert needs the 0 sample first
        assert (
            reg.get_sample_value(PREFIX + "spec_invariant_violations_total", {"invariant": name})
            == 0.0
        )
    m.record_spec_step(g.spec, "<=2k", 4, 4, 1, 3, broken=("depth_equals_accepted",))
    labels = {"invariant": "depth_equals_accepted"}
    assert reg.get_sample_value(PREFIX + "spec_invariant_violations_total", labels) == 1.0
    for reason in m.METRICS["spec_fallback_steps"].labels[0][1]:
        labels = {"reason": reason}
        assert reg.get_sample_value(PREFIX + "spec_fallback_steps_total", labels) == 0.0


def test_service_metrics_label_their_own_service() -> None:
    reg = CollectorRegistry()
    v = m.verify_metrics(reg)
    v.common.service_busy_seconds.inc(0.25)
    v.common.count_protocol_error("malformed")
    busy = reg.get_sample_value(PREFIX + "service_busy_seconds_total", {"service": "verify"})
    labels = {"service": "verify", "code": "malformed"}
    assert busy == 0.25
    assert reg.get_sample_value(PREFIX + "protocol_errors_total", labels) == 1.0


def test_attention_policy_info_and_mismatch() -> None:
    reg = CollectorRegistry()
    d = m.draft_metrics(reg)
    ckpt = [("sliding", 2048)] * 5 + [("full", None)]
    assert m.publish_attention_policy(d, ckpt, ckpt, "checkpoint") is False
    assert reg.get_sample_value(PREFIX + "draft_attention_policy_mismatch") == 0.0
    assert reg.get_sample_value(PREFIX + "draft_sliding_keys_bound") == 5 * 2048
    info = {"layer": "5", "kind": "full", "window": "none", "source": "checkpoint"}
    assert reg.get_sample_value(PREFIX + "draft_attention_policy_info", info) == 1.0
    # the incident: every layer attends to the full history although trained with windows
    forced = [("full", None)] * 6
    assert m.publish_attention_policy(d, forced, ckpt, "override") is True
    assert reg.get_sample_value(PREFIX + "draft_attention_policy_mismatch") == 1.0
    assert reg.get_sample_value(PREFIX + "draft_sliding_keys_bound") == 0
    text = generate_latest(reg).decode()
    assert 'layer="0",source="override",window="none"' in text


def test_verify_exports_graph_captures_as_deltas() -> None:
    from splitflash.models.graphs import CaptureStats
    from splitflash.services.verify.metrics_server import build_verify_metrics

    vm = build_verify_metrics()
    graphs = CaptureStats()
    graphs.failed = False
    graphs.captures, graphs.capture_seconds = 2, 1.5  # two captures before the first export

    def value(name: str, **labels) -> float:
        return vm.registry.get_sample_value(f"splitflash_{name}", labels or None)

    vm.count_forward("graph", graphs)
    vm.count_forward("graph", graphs)  # nothing new: nothing added
    graphs.captures, graphs.capture_seconds, graphs.failed = 3, 2.0, True
    graphs.evictions = 1
    vm.count_forward("eager", graphs)
    vm.count_forward("eager", graphs)  # popped: counted once
    assert value("verify_graph_evictions_total") == 1
    assert value("verify_graph_captures_total") == 3
    assert value("verify_graph_capture_seconds_total") == pytest.approx(2.0)
    assert value("verify_forwards_total", mode="graph") == 2
    assert value("verify_forwards_total", mode="eager") == 2
    assert value("verify_graph_capture_failed") == 1
    vm.count_forward("eager", None)  # CPU: no graphs at all
    assert value("verify_graph_capture_failed") == 0
