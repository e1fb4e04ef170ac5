"""Measured rows from raw observations: a request's trace and metric scrapes. Pure.

Pooled, never averages of averages (DESIGN §4): a row's per-step means are sums over every
step of every request at that context divided by the step count.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
STAT_KEYS = ("steps", "draft_tokens", "accepted_drafts")  # response stats cross-checked


def parse_metrics(text: str) -> Samples:
    """Prometheus text -> {(sample name, sorted labels): value}."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, lab), v in samples.items() if n == name and want <= set(lab))


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, lab), v in samples.items():
        value = dict(lab).get(label)
        if n == name and value is not None:
            out[value] = out.get(value, 0.0) + v
    return out


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    """Counter increase between two scrapes (a restart in between reads as the new value)."""
    a, b = total(after, name, **labels), total(before, name, **labels)
    return a - b if a >= b else a


def summarise(requests: Sequence[Mapping]) -> dict:
    """One row from the requests run at one context. Each request: context (prompt
    tokens), trace (the /trace steps), decode_s (first to last token, seconds), tokens
    (completion tokens), reported (the response's speculative_decoding_stats or {})."""
    steps = [s for r in requests for s in r["trace"]]
    n = len(steps)
    tokens = sum(int(r["tokens"]) for r in requests)
    decode_s = sum(float(r["decode_s"]) for r in requests)

    def mean(key: str) -> float:
        return sum(float(s[key]) for s in steps) / n if n else 0.0

    def fastest(key: str) -> float:
        """The lowest per-request mean of a time per step (ms): on a busy machine one
        scheduler stall in one request would otherwise read as that time growing with
        context. key "step_ms": the request's decode wall time over its steps."""

        def per_step(r: Mapping) -> float:
            if key == "step_ms":
                return 1e3 * float(r["decode_s"]) / len(r["trace"])
            return sum(float(s[key]) for s in r["trace"]) / len(r["trace"])

        return min((per_step(r) for r in requests if r["trace"]), default=0.0)

    # The steps that drafted: with the gateway's speculation gate pausing a drafter, a
    # mean over all steps would hide what its drafts achieve.
    drafting = [s for s in steps if int(s["drafted"])]

    row = {
        "context": round(sum(int(r["context"]) for r in requests) / max(len(requests), 1)),
        "requests": len(requests),
        "steps": n,
        # the first token comes from prefill; the others from decode steps
        "tok_s": (tokens - len(requests)) / decode_s if decode_s > 0 else 0.0,
        "step_ms": fastest("step_ms"),
        "mean_commit_len": mean("commit_len"),
        "drafted": mean("drafted"),
        "accepted_drafts": mean("accepted_drafts"),
        "accepted_depth": mean("accepted_depth"),
        "draft_ms": fastest("draft_ms"),
        "verify_ms": fastest("verify_ms"),
        "transport_ms": fastest("transport_ms"),
        "no_draft_fraction": (n - len(drafting)) / n if n else 0.0,
        "trace_totals": {
            "steps": n,
            "draft_tokens": sum(int(s["drafted"]) for s in steps),
            "accepted_drafts": sum(int(s["accepted_drafts"]) for s in steps),
        },
    }
    if all("queue_ms" in s for s in steps):  # gateways before the queue phase lack it
        row["queue_ms"] = fastest("queue_ms")
    if drafting:
        row["drafting_commit_len"] = sum(float(s["commit_len"]) for s in drafting) / len(drafting)
        row["drafting_drafted"] = sum(float(s["drafted"]) for s in drafting) / len(drafting)
    reported = [r.get("reported") or {} for r in requests]
    if all(all(k in rep for k in STAT_KEYS) for rep in reported):
        row["reported"] = {k: sum(int(rep[k]) for rep in reported) for k in STAT_KEYS}
    return row


def worker_figures(
    draft: tuple[Samples, Samples] | None,
    verify: tuple[Samples, Samples] | None,
    steps: int,
) -> dict:
    """Per-context figures from (before, after) worker scrapes around that context's
    requests (run one at a time, so every increase belongs to them)."""
    out: dict = {}
    if draft is not None:
        before, after = draft
        drafts = delta(after, before, "splitflash_draft_steps_total")
        if drafts > 0:
            kinds = set(by_label(after, "splitflash_draft_kv_keys_read_total", "layer_kind"))
            out["keys_per_draft"] = {
                k: delta(after, before, "splitflash_draft_kv_keys_read_total", layer_kind=k)
                / drafts
                for k in sorted(kinds)
            }
    if verify is not None and steps:
        before, after = verify
        read = delta(after, before, "splitflash_verify_kv_bytes_read_total")
        if read > 0:
            out["bytes_per_step"] = read / steps
    for svc, scrapes in (("verify", verify), ("draft", draft)):
        if scrapes is not None:
            out.update(_graph_figures(svc, *scrapes))
    return out


def _graph_figures(svc: str, before: Samples, after: Samples) -> dict:
    """How `svc`'s forwards ran (graph_rules.py): the eager share, captures made and the
    seconds they stalled steps, graphs dropped from the LRU, and the capture-failed gauge.
    {} for a service without forwards counted (n-gram drafter, no step in between)."""
    prefix = f"splitflash_{svc}"
    forwards = delta(after, before, f"{prefix}_forwards_total")
    if forwards <= 0:
        return {}
    eager = delta(after, before, f"{prefix}_forwards_total", mode="eager")
    return {
        f"{svc}_eager_fraction": eager / forwards,
        f"{svc}_graph_captures": delta(after, before, f"{prefix}_graph_captures_total"),
        f"{svc}_capture_ms": 1e3 * delta(after, before, f"{prefix}_graph_capture_seconds_total"),
        f"{svc}_graph_evictions": delta(after, before, f"{prefix}_graph_evictions_total"),
        f"{svc}_graph_failed": total(after, f"{prefix}_graph_capture_failed"),
    }
