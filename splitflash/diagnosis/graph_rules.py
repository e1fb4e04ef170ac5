"""Rules on how the worker steps ran: CUDA-graphed or eager. Pure: (rows, policy) -> Finding.

A small model's step launched kernel by kernel costs several times its graph replay (the
default model's verify step at batch 1 on an H100: 12.7-17.2 ms eager against 0.77-2.38 ms
graphed, bench/RESULTS.md "Session 24"), and nothing in the per-step figures says which ran:
the step is merely slow. Row keys (from the worker scrapes around a context's requests,
rows.worker_figures), per service "verify" / "draft": {svc}_eager_fraction (forwards that
ran eagerly over all forwards), {svc}_graph_failed (the capture-failed gauge after the
requests), {svc}_graph_captures and {svc}_capture_ms (graphs captured while those requests
ran, and the time they stalled them), {svc}_graph_evictions (graphs their steps dropped from
the LRU).
"""

from __future__ import annotations

from collections.abc import Sequence

from splitflash.diagnosis.findings import Finding, PolicyInfo
from splitflash.diagnosis.judging import Row, ctx, judged, num

SERVICES = ("verify", "draft")
EAGER_SHARE = 0.5  # more than this share of a context's forwards eager: named

# Why a graphed deployment still runs a step eagerly, per service (graphs.py / dflash/graphs.py).
_EAGER_CAUSES = {
    "verify": "more requests in a step than graph_max_batch, or a KV pool without room to "
    "pad a step's blocks to one length",
    "draft": "requests outside the draft KV pool (pool_slots full, or a context longer than "
    "pool_context), or more requests in a step than the largest graph",
}


def graph_capture_failed(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    failed = [s for s in SERVICES if any((num(r, f"{s}_graph_failed") or 0) >= 1 for r in rows)]
    if not failed:
        return None
    gauges = ", ".join(f"splitflash_{s}_graph_capture_failed" for s in failed)
    return Finding(
        "graph_capture_failed",
        f"a CUDA graph capture failed in {' and '.join(failed)} ({gauges} = 1): every step "
        f"there runs eagerly from then on, launching its kernels one by one; the error is in "
        f"the service's log",
    )


def steps_not_graphed(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    """Eager steps on a service that replays graphs at other contexts (so graphs are on and
    work). A service with no graph forward anywhere (CPU, graphs off) is not judged."""
    for svc in SERVICES:
        key = f"{svc}_eager_fraction"
        measured = [r for r in judged(rows) if num(r, key) is not None]
        if not any(num(r, key) < 1.0 for r in measured):
            continue
        bad = [r for r in measured if num(r, key) > EAGER_SHARE]
        if bad:
            where = ", ".join(f"{num(r, key):.0%} at {ctx(r['context'])}" for r in bad)
            return Finding(
                "steps_not_graphed",
                f"{svc} ran its forwards eagerly ({where}) although it replays CUDA graphs "
                f"at other contexts: those steps pay every kernel launch. Likely: "
                f"{_EAGER_CAUSES[svc]}",
            )
    return None


def graphs_evicted(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    """Doctor's probe is one request at a time over a few contexts: a handful of graph keys.
    If even that drops graphs from the LRU, real traffic (more batch sizes, block lengths
    and contexts at once) drops and captures again all the time."""
    dropped = {s: sum(num(r, f"{s}_graph_evictions") or 0 for r in rows) for s in SERVICES}
    dropped = {s: n for s, n in dropped.items() if n > 0}
    if not dropped:
        return None
    what = " and ".join(f"{svc} {n:.0f}" for svc, n in dropped.items())
    return Finding(
        "graph_lru_too_small",
        f"CUDA graphs dropped from a full LRU while doctor's single requests ran ({what}): "
        f"each key met again is captured again, stalling its step by tens of ms, and real "
        f"traffic meets more keys than this probe. Raise SPLITFLASH_VERIFY_GRAPH_MAX_HELD / "
        f"SPLITFLASH_DRAFT_GRAPH_MAX_HELD where GPU memory allows",
    )
