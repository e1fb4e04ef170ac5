"""Rules on how the figures change with context: step time vs bytes read, throughput,
the drafter's sliding window (policy, keys read, draft time), acceptance. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from splitflash.diagnosis.findings import Finding, PolicyInfo
from splitflash.diagnosis.judging import (
    EPS,
    GROWTH,
    STUCK_COMMIT,
    Row,
    ctx,
    ends,
    judged,
    num,
)


def step_outgrows_bytes(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    pair = ends(rows, "step_ms")
    if pair is None:
        return None
    lo, hi = pair
    step_g = float(hi["step_ms"]) / float(lo["step_ms"])
    span = f"{ctx(lo['context'])} to {ctx(hi['context'])} context"
    b_lo, b_hi = num(lo, "bytes_per_step"), num(hi, "bytes_per_step")
    if b_lo and b_hi:
        faster = step_g / (b_hi / b_lo)
        if faster <= GROWTH:
            return None
        seen = (
            f"step time grows {faster:.0f}x faster than the bytes read ({step_g:.1f}x step "
            f"time for {b_hi / b_lo:.2f}x bytes from {span})"
        )
    else:
        ctx_g = float(hi["context"]) / float(lo["context"])
        # No byte counts: a decode step is memory-bound and weights dominate short contexts,
        # so step time growing about as fast as the context itself is already anomalous.
        if step_g < GROWTH or step_g < 0.5 * ctx_g:
            return None
        seen = (
            f"step time grows {step_g:.0f}x ({float(lo['step_ms']):.1f} -> "
            f"{float(hi['step_ms']):.1f} ms) from {span} ({ctx_g:.0f}x): linear in context"
        )
    return Finding(
        "step_outgrows_bytes",
        f"{seen}; a decode step should cost about the memory it reads. Likely cause: work "
        f"linear in context that is not memory traffic (a drafter re-reading its whole "
        f"history, a window applied after the QK product, a dense prefix mask built per step)",
        "critical",
    )


def throughput_collapse(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    pair = ends(rows, "tok_s")
    if pair is None:
        return None
    lo, hi = pair
    drop = float(lo["tok_s"]) / float(hi["tok_s"])
    if drop < 10:
        return None
    return Finding(
        "throughput_collapse",
        f"decode speed falls {drop:.0f}x, from {float(lo['tok_s']):.1f} tok/s at "
        f"{ctx(lo['context'])} to {float(hi['tok_s']):.1f} tok/s at {ctx(hi['context'])} "
        f"context; a memory-bound decode slows with the KV it reads, not this fast (see the "
        f"step-time and window findings for the cause)",
        "critical",
    )


def _keys_growth(rows: Sequence[Row]) -> str:
    """Evidence from the drafter's keys-read metric: total keys per draft, short vs long."""
    have = [r for r in judged(rows) if isinstance(r.get("keys_per_draft"), Mapping)]
    if len(have) < 2:
        return ""
    lo, hi = (sum(float(v) for v in r["keys_per_draft"].values()) for r in (have[0], have[-1]))
    if lo <= 0 or hi < 1.5 * lo:
        return ""
    return (
        f"context keys read per draft grow {hi / lo:.1f}x ({lo:.0f} at "
        f"{ctx(have[0]['context'])} -> {hi:.0f} at {ctx(have[-1]['context'])})"
    )


def _sliding_over_bound(rows: Sequence[Row], policy: PolicyInfo) -> str:
    if not policy.sliding_keys_bound:
        return ""
    for r in judged(rows):
        keys = r.get("keys_per_draft")
        got = float(keys.get("sliding", 0)) if isinstance(keys, Mapping) else 0.0
        if got > policy.sliding_keys_bound + EPS:
            return (
                f"its sliding layers read {got:.0f} keys per draft at {ctx(r['context'])}, "
                f"more than their windows allow ({policy.sliding_keys_bound:.0f})"
            )
    return ""


def _draft_time_growth(rows: Sequence[Row]) -> str:
    pair = ends(rows, "draft_ms")
    if pair is None:
        return ""
    lo, hi = pair
    a, b = float(lo["draft_ms"]), float(hi["draft_ms"])
    if b < 2 * a or b - a < 1.0:  # under 1 ms apart: timer noise on a tiny drafter
        return ""
    return (
        f"draft time grows {b / a:.1f}x with context ({a:.1f} ms at {ctx(lo['context'])} "
        f"-> {b:.1f} ms at {ctx(hi['context'])})"
    )


def window_not_applied(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    """Evidence from the exported policy (window off / mismatch gauge), the keys-read metric
    and the draft time. With a tiny drafter on a CPU the time may not grow measurably, so
    the policy and keys read count as evidence of their own."""
    if not policy.sliding_in_checkpoint:
        return None
    declared = policy.describe()
    evidence = []
    if policy.window_not_in_force:
        evidence.append(
            f"{declared} in the checkpoint but only {policy.sliding_in_force} slide in force"
            + (" (window_override=off)" if policy.window_off else "")
        )
    elif policy.mismatch:
        evidence.append("the drafter's policy in force differs from its checkpoint's")
    over = _sliding_over_bound(rows, policy)
    if over:
        evidence.append(over)
    keys = _keys_growth(rows) if evidence else ""  # full layers' reads grow by design
    if keys:
        evidence.append(keys)
    time = _draft_time_growth(rows)
    if time:
        evidence.append(time + ("" if evidence else f" although {declared}"))
    if not evidence:
        return None
    return Finding(
        "window_not_applied",
        f"{'; '.join(evidence)}: the sliding window is not applied, so drafting cost grows "
        f"with context (and acceptance may fall: the drafter was trained with its window)",
        "critical",
    )


def acceptance_falls(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    pair = ends(rows, "mean_commit_len")
    if pair is None:
        return None
    lo, hi = pair
    a, b = float(lo["mean_commit_len"]), float(hi["mean_commit_len"])
    if a < 1.5 or b > 0.6 * a or b <= STUCK_COMMIT:  # stuck at 1 is commit_len_stuck's
        return None
    return Finding(
        "acceptance_falls",
        f"mean commit_len falls from {a:.2f} at {ctx(lo['context'])} to {b:.2f} at "
        f"{ctx(hi['context'])} context: the drafter loses track of long context (trained at "
        f"shorter context, or run with an attention policy it was not trained with)",
    )
