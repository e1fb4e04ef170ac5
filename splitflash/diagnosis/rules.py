"""Anomaly rules over measured rows: pure functions, (rows, policy) -> list[Finding].

A row is what `splitflash doctor` measured at one context length (per decode step means over
one or more greedy requests; DESIGN.md §4 terms):
  context (prompt tokens), steps, tok_s (decode tokens/s), step_ms (wall ms per step),
  mean_commit_len (c), drafted (K per step), accepted_drafts (a per step),
  accepted_depth (d per step), draft_ms, verify_ms, transport_ms (the times: the fastest
  of the repeated requests' means),
  optional: queue_ms (waited in a worker's queue behind its other work, e.g. a prefill
  chunk), bytes_per_step (verify bytes read per step), keys_per_draft
  ({layer_kind: context keys read per draft}), no_draft_fraction (steps with K == 0),
  paused_fraction (steps the gateway's speculation gate ran without drafts),
  drafting_commit_len / drafting_drafted (c and K per step over the steps with K > 0),
  trace_totals / reported ({steps, draft_tokens, accepted_drafts}: summed over the trace
  vs the response's speculative_decoding_stats), and how the worker steps ran
  ({verify,draft}_eager_fraction, _graph_captures, _capture_ms, _graph_evictions,
  _graph_failed: graph_rules.py).
Missing keys mean "not measured": a rule that needs them says nothing.
Each rule returns at most one Finding, naming the evidence and the likely cause.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from splitflash.diagnosis.context_rules import (
    acceptance_falls,
    step_outgrows_bytes,
    throughput_collapse,
    window_not_applied,
)
from splitflash.diagnosis.findings import Finding, PolicyInfo
from splitflash.diagnosis.graph_rules import (
    graph_capture_failed,
    graphs_evicted,
    steps_not_graphed,
)
from splitflash.diagnosis.judging import Row, ctx
from splitflash.diagnosis.step_rules import (
    commit_len_stuck,
    drafter_silent,
    invariants_broken,
    metrics_contradict,
    speculation_paused,
    stats_disagree,
    steps_queued,
)

__all__ = ["RULES", "Row", "ctx", "diagnose"]

RULES: tuple[Callable[[Sequence[Row], PolicyInfo], Finding | None], ...] = (
    commit_len_stuck,
    metrics_contradict,
    stats_disagree,
    window_not_applied,
    step_outgrows_bytes,
    throughput_collapse,
    acceptance_falls,
    drafter_silent,
    speculation_paused,
    steps_queued,
    graph_capture_failed,
    steps_not_graphed,
    graphs_evicted,
)


def diagnose(
    rows: Sequence[Row],
    policy: PolicyInfo | None = None,
    violations: Mapping[str, float] | None = None,
) -> list[Finding]:
    """Every anomaly in `rows`, most important first; [] for a healthy deployment."""
    policy = policy or PolicyInfo()
    found = [rule(rows, policy) for rule in RULES]
    found.append(invariants_broken(violations or {}))
    return [f for f in found if f is not None]
