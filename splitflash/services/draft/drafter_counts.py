"""What a draft call did, from the counters drafters with a forward keep (DFlash): context
keys read per layer kind, forwards by mode (graph / eager) and CUDA-graph captures,
failures and evictions, into the draft service's metrics after each Propose."""

from __future__ import annotations

from splitflash.services.common.metric_math import context_bucket
from splitflash.services.common.metrics import DraftMetrics
from splitflash.services.draft.registry import Drafter


def count_drafter_work(drafter: Drafter, metrics: DraftMetrics, longest: int) -> None:
    """longest: the call's longest context, the bucket the keys read are counted in."""
    pop_keys = getattr(drafter, "pop_keys_read", None)
    if callable(pop_keys):
        bucket = context_bucket(longest)
        for kind, n in pop_keys().items():
            metrics.draft_kv_keys_read.labels(layer_kind=kind, context_bucket=bucket).inc(n)
    pop_forwards = getattr(drafter, "pop_forwards", None)
    if not callable(pop_forwards):
        return
    for mode, n in pop_forwards().items():
        metrics.draft_forwards.labels(mode=mode).inc(n)
    metrics.draft_graph_capture_failed.set(int(drafter.graph_capture_failed))
    n, seconds = drafter.pop_capture_stats()
    metrics.draft_graph_captures.inc(n)
    metrics.draft_graph_capture_seconds.inc(seconds)
    metrics.draft_graph_evictions.inc(drafter.pop_graph_evictions())
