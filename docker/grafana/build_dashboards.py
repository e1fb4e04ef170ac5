"""Writes the Grafana dashboards (docker/grafana/dashboards/*.json) from the panels below.

The JSON files are generated, not hand-edited: change a panel here and run
`python3 docker/grafana/build_dashboards.py`. tests/unit/test_docker_config.py fails when the
files and this script disagree, and checks every metric and label in every query against
splitflash/services/common/metric_math.METRICS.

Pooled figures only (DESIGN.md §4): every ratio is sum(rate(numerator)) / sum(rate(denominator)),
never an average of per-request or per-instance ratios.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DS = {"type": "prometheus", "uid": "prometheus"}  # provisioning/datasources/prometheus.yml
R = "[$__rate_interval]"
OUT = Path(__file__).parent / "dashboards"


def rate(expr: str, by: str = "") -> str:
    """sum [by (labels)] (rate(expr[$__rate_interval]))."""
    return f"sum by ({by}) (rate({expr}{R}))" if by else f"sum(rate({expr}{R}))"


def panel(title: str, desc: str, *targets: tuple[str, str], unit: str = "short", **kw) -> dict:
    """A panel; targets are (PromQL, legend). kw: kind, w, h, instant, fmt, stack, max."""
    kind = kw.get("kind", "timeseries")
    defaults: dict = {"unit": unit}
    if "max" in kw:
        defaults["max"] = kw["max"]
    if kind == "timeseries":
        stacking = {"mode": "normal" if kw.get("stack") else "none"}
        defaults["custom"] = {"stacking": stacking, "fillOpacity": 15 if kw.get("stack") else 0}
    return {
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"w": kw.get("w", 12), "h": kw.get("h", 8)},
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": DS,
                "expr": expr,
                "legendFormat": legend,
                "instant": kw.get("instant", False),
                "range": not kw.get("instant", False),
                "format": kw.get("fmt", "time_series"),
            }
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def quantiles(metric: str, by: str = "") -> list[tuple[str, str]]:
    extra = f"{by}, " if by else ""
    return [
        (
            f"histogram_quantile({q}, sum by ({extra}le) (rate({metric}_bucket{R})))",
            f"p{int(q * 100)}" + (f" {{{{{by}}}}}" if by else ""),
        )
        for q in (0.5, 0.95, 0.99)
    ]


SPEC_P = "splitflash_spec_"
MEAN_COMMIT = f"{rate(SPEC_P + 'commit_len_sum')} / {rate(SPEC_P + 'commit_len_count')}"
ACCEPT = f"{rate(SPEC_P + 'accepted_tokens_total')} / {rate(SPEC_P + 'draft_tokens_total')}"
PER_POS = (
    "sum by (position) (increase(splitflash_spec_accepted_tokens_per_pos_total[$__range]))"
    " / sum by (position) (increase(splitflash_spec_drafted_per_pos_total[$__range]))"
)
B = "context_bucket"

SPEC = [
    panel("Tokens/s", "Tokens streamed to clients per second, all requests.",
          (rate("splitflash_generated_tokens_total"), "tokens/s"), unit="suffix: tok/s"),
    panel("Mean commit length", "sum(c) / steps: tokens committed per verify step, bonus "
          "included. 1.0 = speculation gains nothing.", (MEAN_COMMIT, "tau"),
          unit="suffix: tok/step"),
    panel("Acceptance rate", "sum(accepted drafts) / sum(proposed drafts).",
          (ACCEPT, "acceptance"), unit="percentunit", max=1),
    panel("Acceptance by position (time range)", "Steps that accepted position i / steps "
          "that drafted position i (0 = first draft token).", (PER_POS, "pos {{position}}"),
          unit="percentunit", kind="bargauge", instant=True, max=1),
    panel("Commit length distribution (time range)", "Request-steps by tokens committed.",
          ("sum by (le) (increase(splitflash_spec_commit_len_bucket[$__range]))", "{{le}}"),
          kind="bargauge", instant=True, fmt="heatmap"),
    panel("Draft tokens/s: accepted vs rejected", "Proposed drafts split into kept and thrown "
          "away; rejected work is the cost of speculation.",
          (rate("splitflash_spec_accepted_tokens_total"), "accepted"),
          (f"{rate('splitflash_spec_draft_tokens_total')} - "
           f"{rate('splitflash_spec_accepted_tokens_total')}", "rejected"),
          unit="suffix: tok/s", stack=True),
    panel("Fallback steps/s by reason", "Request-steps decoded without drafts (drafter down, "
          "past deadline, disabled, error, or unprofitable: paused by the gateway because "
          "plain steps decoded faster).",
          (rate("splitflash_spec_fallback_steps_total", "reason"), "{{reason}}"),
          unit="suffix: steps/s", stack=True),
    panel("Speculation gate: one request's decode speed each way", "What the gateway "
          "measures and compares, per context bucket of a step's longest request: tokens "
          "committed per request / step seconds over recent speculative and plain steps "
          "(0: not measured at that context yet). Drafting pauses where plain is above "
          "speculative (a drafter that no longer predicts the text, often only past some "
          "context).",
          ("max by (mode, context_bucket) (splitflash_spec_gate_tokens_per_second)",
           "{{mode}} {{context_bucket}}"),
          unit="suffix: tok/s"),
    panel("Invariant violations", "Broken §4 invariants per interval; must stay 0.",
          (f"sum by (invariant) (increase(splitflash_spec_invariant_violations_total{R}))",
           "{{invariant}}"), stack=True),
    panel("Verify steps/s and truncated steps/s", "Request-steps per second; truncated = "
          "request finished inside the step (c < a + 1, expected at stops).",
          (rate("splitflash_spec_verify_steps_total"), "steps"),
          (rate("splitflash_spec_truncated_steps_total"), "truncated"), unit="suffix: steps/s"),
]  # fmt: skip

STEP_MEAN = f"{rate('splitflash_step_seconds_sum', B)} / {rate('splitflash_step_seconds_count', B)}"
PHASE_BY = f"phase, {B}"
DRAFT_VERIFY, DV = "splitflash_step_phase_by_context_seconds", '{phase=~"draft|verify"}'
LONGCTX = [
    panel("Mean step time by context bucket", "Batched decode step wall time; bucket = longest "
          "context in the batch.", (STEP_MEAN, "{{context_bucket}}"), unit="s"),
    panel("p95 step time by context bucket", "", *quantiles("splitflash_step_seconds", B)[1:2],
          unit="s"),
    panel("Decode tokens/s per request by context bucket", "(tokens per request-step) / "
          "(seconds per step): one request's decode speed at that context.",
          (f"({rate('splitflash_generated_tokens_total', B)} / "
           f"{rate('splitflash_spec_verify_steps_total', B)}) / ({STEP_MEAN})",
           "{{context_bucket}}"), unit="suffix: tok/s"),
    panel("Tokens/s by context bucket (all requests)", "",
          (rate("splitflash_generated_tokens_total", B), "{{context_bucket}}"),
          unit="suffix: tok/s", stack=True),
    panel("Draft vs verify time per step by context bucket", "Mean seconds per step of each "
          "phase; a drafter whose time grows with context is not applying its window.",
          (f"{rate(DRAFT_VERIFY + '_sum' + DV, PHASE_BY)} / "
           f"{rate(DRAFT_VERIFY + '_count' + DV, PHASE_BY)}", "{{phase}} {{context_bucket}}"),
          unit="s"),
    panel("Draft KV keys read per draft, by layer kind", "Context keys read per draft summed "
          "over the layers of each kind; sliding must stay under the bound at any context.",
          (f"{rate('splitflash_draft_kv_keys_read_total', f'layer_kind, {B}')} / on ({B}) "
           f"group_left {rate('splitflash_draft_steps_total', B)}",
           "{{layer_kind}} {{context_bucket}}"),
          ("max(splitflash_draft_sliding_keys_bound)", "sliding bound (sum of windows)")),
    panel("Prefill chunk time by context bucket (p99)", "One prompt chunk's forward on a "
          "verify instance: the running requests there wait this long for their next step "
          "(lower VERIFY_PREFILL_CHUNK to shorten it); bucket = the chunk's last position.",
          *quantiles("splitflash_verify_prefill_chunk_seconds", B)[2:], unit="s"),
    panel("Verify bytes read per step by context bucket", "KV + weights read per verify step.",
          (f"{rate('splitflash_verify_kv_bytes_read_total', B)} / "
           f"{rate('splitflash_step_seconds_count', B)}", "{{context_bucket}}"), unit="bytes"),
    panel("Step seconds per GB read by context bucket", "Should fall or stay flat as context "
          "grows (memory-bound); rising = work growing faster than bytes (alert "
          "StepTimeOutgrowsBytesRead).",
          (f"1e9 * {rate('splitflash_step_seconds_sum', B)} / "
           f"{rate('splitflash_verify_kv_bytes_read_total', B)}", "{{context_bucket}}"),
          unit="s"),
    panel("Acceptance rate by context bucket", "Falls with context when the drafter's "
          "attention policy is not the one it was trained with.",
          (f"{rate('splitflash_spec_accepted_tokens_total', B)} / "
           f"{rate('splitflash_spec_draft_tokens_total', B)}", "{{context_bucket}}"),
          unit="percentunit", max=1),
    panel("Mean commit length by context bucket", "tokens streamed / request-steps.",
          (f"{rate('splitflash_generated_tokens_total', B)} / "
           f"{rate('splitflash_spec_verify_steps_total', B)}", "{{context_bucket}}"),
          unit="suffix: tok/step"),
    panel("Drafter attention policy in force", "Per layer; mismatch = differs from the "
          "checkpoint's config.",
          ("max by (layer, kind, window, source) (splitflash_draft_attention_policy_info)", ""),
          kind="table", instant=True, fmt="table"),
    panel("Policy mismatch", "1 = the drafter runs a policy its checkpoint does not declare.",
          ("max(splitflash_draft_attention_policy_mismatch)", "mismatch"), kind="stat",
          instant=True),
]  # fmt: skip

PHASE_MEAN = (
    f"{rate('splitflash_step_phase_seconds_sum', 'phase')} / "
    f"{rate('splitflash_step_phase_seconds_count', 'phase')}"
)
SERVICES = [
    panel("Request rate by endpoint and status", "",
          (rate("splitflash_requests_total", "endpoint, status"), "{{endpoint}} {{status}}"),
          unit="reqps", stack=True),
    panel("Request latency p95 by endpoint", "",
          *quantiles("splitflash_request_seconds", "endpoint")[1:2], unit="s"),
    panel("Time to first token", "", *quantiles("splitflash_ttft_seconds"), unit="s"),
    panel("Inter-token latency", "", *quantiles("splitflash_inter_token_seconds"), unit="s"),
    panel("Queue depth", "", ("sum(splitflash_running_requests)", "running"),
          ("sum(splitflash_prefilling_requests)", "prefilling"),
          ("sum(splitflash_waiting_requests)", "waiting")),
    panel("KV cache usage", "Pages in use / allocated, per verify instance.",
          ("sum by (instance) (splitflash_kv_pages_used) / "
           "sum by (instance) (splitflash_kv_pages_total)", "{{instance}}"),
          unit="percentunit", max=1),
    panel("Step time split by phase", "Mean seconds per step of each phase, stacked.",
          (PHASE_MEAN, "{{phase}}"), unit="s", stack=True),
    panel("Busy fraction per service", "Share of wall time each instance spends working.",
          (rate("splitflash_service_busy_seconds_total", "service, instance"),
           "{{service}} {{instance}}"), unit="percentunit", max=1),
    panel("Protocol errors/s", "Frames answered with an Error reply, by service and code.",
          (rate("splitflash_protocol_errors_total", "service, code"), "{{service}} {{code}}")),
    panel("Verify forwards by mode",
          "graph = a replayed CUDA graph; eager = kernels launched one by one (CPU, mixed "
          "block lengths without KV room to pad them, batches past the largest graph, or "
          "graphs off/failed). A GPU "
          "deployment should be nearly all graph; capture_failed = 1 means it fell back. "
          "captures = CUDA graphs captured while serving, capture s/s = the share of time "
          "those stalls took; steady traffic should stop adding them. evictions = graphs "
          "dropped from a full LRU: under steady traffic, raise GRAPH_MAX_HELD. "
          "batch_invariant = 1: steps computed bit for bit as target-only decoding would "
          "(exact greedy in bf16, slower); 0: fast kernels.",
          (rate("splitflash_verify_forwards_total", "mode"), "{{mode}}"),
          ("max(splitflash_verify_graph_capture_failed)", "capture_failed"),
          ("max(splitflash_verify_batch_invariant)", "batch_invariant"),
          ("sum(rate(splitflash_verify_graph_captures_total[5m]))", "captures"),
          ("sum(rate(splitflash_verify_graph_capture_seconds_total[5m]))", "capture s/s"),
          ("sum(rate(splitflash_verify_graph_evictions_total[5m]))", "evictions"),
          unit="ops"),
    panel("Draft forwards by mode",
          "DFlash only. graph = a replayed CUDA graph over the draft KV pool; eager = kernels "
          "launched one by one (CPU, requests outside the pool, batches past the largest "
          "graph, or graphs off/failed). capture_failed = 1 means it fell back. captures, "
          "capture s/s: graphs captured while serving and the share of time they stalled; "
          "evictions: graphs dropped from a full LRU (raise GRAPH_MAX_HELD if steady).",
          (rate("splitflash_draft_forwards_total", "mode"), "{{mode}}"),
          ("max(splitflash_draft_graph_capture_failed)", "capture_failed"),
          ("sum(rate(splitflash_draft_graph_captures_total[5m]))", "captures"),
          ("sum(rate(splitflash_draft_graph_capture_seconds_total[5m]))", "capture s/s"),
          ("sum(rate(splitflash_draft_graph_evictions_total[5m]))", "evictions"),
          unit="ops"),
    panel("Targets up", "", ('up{job=~"splitflash-.*"}', "{{job}} {{instance}}"), max=1),
]  # fmt: skip

DASHBOARDS = {
    "speculative.json": ("splitflash-speculative", "splitflash: speculative decoding", SPEC),
    "long-context.json": ("splitflash-long-context", "splitflash: long context", LONGCTX),
    "services.json": ("splitflash-services", "splitflash: services", SERVICES),
}


def dashboard(uid: str, title: str, panels: list[dict]) -> dict:
    x = y = row_h = 0
    laid = []
    for pid, p in enumerate(panels, start=1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24:  # next row of the 24-column grid
            x, y, row_h = 0, y + row_h, 0
        laid.append({"id": pid, **p, "gridPos": {"x": x, "y": y, "w": w, "h": h}})
        x, row_h = x + w, max(row_h, h)
    return {
        "uid": uid,
        "title": title,
        "tags": ["splitflash"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": []},
        "annotations": {"list": []},
        "panels": laid,
    }


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        name: json.dumps(dashboard(uid, title, panels), indent=2) + "\n"
        for name, (uid, title, panels) in DASHBOARDS.items()
    }


if __name__ == "__main__":
    OUT.mkdir(exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}", file=sys.stderr)
