"""Rules on the per-step figures themselves (DESIGN §4): stuck commit_len, figures that
contradict each other, stats that disagree, a silent drafter, counted invariant breaks,
steps that waited behind a worker's other work.
Pure: (rows, policy) -> Finding | None; row keys are listed in rules.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from splitflash.diagnosis.findings import Finding, PolicyInfo
from splitflash.diagnosis.judging import (
    EPS,
    STUCK_COMMIT,
    Row,
    ctx,
    judged,
    num,
)


def _drafting(r: Row) -> tuple[float | None, float | None]:
    """(commit_len, drafts) per step over the steps that drafted, where the row has them
    (a paused drafter's steps otherwise dilute both), else over all steps."""
    if num(r, "drafting_drafted") is not None:
        return num(r, "drafting_commit_len"), num(r, "drafting_drafted")
    return num(r, "mean_commit_len"), num(r, "drafted")


def commit_len_stuck(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    bad = [
        r
        for r in judged(rows)
        if (_drafting(r)[1] or 0) >= 1 and (_drafting(r)[0] or 9) <= STUCK_COMMIT
    ]
    if not bad:
        return None
    r = bad[0]
    commit, drafted = _drafting(r)
    where = ", ".join(ctx(b["context"]) for b in bad)
    note = (
        " (the 'garbage' experiment drafter is running: expected)"
        if policy.drafter == ("garbage")
        else ""
    )
    return Finding(
        "commit_len_stuck",
        f"mean commit_len {commit:.2f} with {drafted:.0f} drafts per step (steps that drafted; "
        f"context {where}): every draft rejected, or drafter and target out "
        f"of step (context/KV desync, wrong target layers or mask token, or an attention "
        f"policy the drafter was not trained with){note}",
        "critical",
    )


def metrics_contradict(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    """DESIGN §4: d == a, c == a + 1 (c a little lower when a request ends inside a step)."""
    for r in judged(rows):
        a, d, c = (num(r, k) for k in ("accepted_drafts", "accepted_depth", "mean_commit_len"))
        k, steps = num(r, "drafted"), float(r["steps"])
        if a is not None and d is not None and abs(d - a) > EPS:
            what = f"accepted_depth {d:.2f} but accepted_drafts {a:.2f}"
            rule = "d == a"
        elif (
            a is not None
            and c is not None
            and not (a + 1 - (max(k or 0, a) + 1) / steps - EPS <= c <= a + 1 + EPS)
        ):
            what = f"mean commit_len {c:.2f} but accepted_drafts {a:.2f}"
            rule = "c == a + 1"
        elif a is not None and k is not None and a > k + EPS:
            what = f"accepted_drafts {a:.2f} but only {k:.2f} drafted"
            rule = "a <= K"
        else:
            continue
        return Finding(
            "metrics_contradict",
            f"{what} per step at context {ctx(r['context'])}: the metrics contradict each "
            f"other (DESIGN §4: {rule}); one of them is counted wrong or read from the wrong "
            f"buffer, so no speculative figure here can be trusted",
            "critical",
        )
    return None


def drafter_silent(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    """A model drafter (not n-gram lookup, which often has nothing to propose) that
    proposes nothing on most steps is down, past its deadline or refusing requests. Steps
    the gateway's speculation gate paused are not the drafter's silence (speculation_paused)."""
    if policy.drafter in ("", "ngram", "none"):
        return None
    for r in judged(rows):
        frac = num(r, "no_draft_fraction")
        if frac is not None:
            frac -= num(r, "paused_fraction") or 0.0
        if frac is not None and frac > 0.5:
            return Finding(
                "drafter_silent",
                f"drafter {policy.drafter} proposed nothing on {frac:.0%} of the steps at "
                f"{ctx(r['context'])}: the steps ran as plain decode (drafter down, past its "
                f"deadline, or refusing the request, e.g. missing target features)",
            )
    return None


def stats_disagree(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    for r in rows:
        got, want = r.get("trace_totals"), r.get("reported")
        if not (isinstance(got, Mapping) and isinstance(want, Mapping)):
            continue
        diff = [k for k in want if k in got and got[k] != want[k]]
        if diff:
            pairs = ", ".join(f"{k} {got[k]} vs {want[k]}" for k in diff)
            return Finding(
                "stats_disagree",
                f"at {ctx(r.get('context', 0))} the per-step trace and the response's "
                f"speculative_decoding_stats disagree ({pairs}): a step is counted in one "
                f"place and not the other",
                "critical",
            )
    return None


def invariants_broken(violations: Mapping[str, float]) -> Finding | None:
    total = sum(violations.values())
    if total <= 0:
        return None
    parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(violations.items()) if v > 0)
    return Finding(
        "invariant_violations",
        f"invariant violations counted: {total:.0f} ({parts}); see DESIGN §4: the figures "
        f"they relate cannot all be right (kv_length = drafter/target desync)",
        "critical",
    )


def speculation_paused(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    """The gateway's speculation gate ran most steps without drafts: plain decoding was
    faster there than drafting (fallback reason "unprofitable")."""
    for r in judged(rows):
        frac = num(r, "paused_fraction")
        if frac is not None and frac > 0.5:
            commit, _ = _drafting(r)
            drafted = f"; its drafting steps committed {commit:.2f} tokens each" if commit else ""
            return Finding(
                "speculation_paused",
                f"the gateway paused drafting on {frac:.0%} of the steps at {ctx(r['context'])}:"
                f" plain decoding was faster there than drafting with {policy.drafter or 'the'}"
                f" drafter{drafted}. Requests run at about target-only speed; the drafter does "
                f"not pay here (see the other findings for why)",
            )
    return None


QUEUED_SHARE = 0.3  # the StepsQueuedBehindOtherWork alert's threshold, same meaning


def steps_queued(rows: Sequence[Row], policy: PolicyInfo) -> Finding | None:
    """Steps that spent a large share of their time queued in a worker behind its other
    work: the deployment is busy admitting other requests (or a worker is shared), so the
    step times measured here are not the steps' own."""
    for r in judged(rows):
        queued, step = num(r, "queue_ms"), num(r, "step_ms")
        if queued is not None and step and queued > QUEUED_SHARE * step:
            return Finding(
                "steps_queued",
                f"steps at {ctx(r['context'])} waited {queued:.1f} ms of their {step:.1f} ms "
                f"in a worker's queue behind its other work (other requests' prompt chunks, "
                f"a long feature append): the step times here include that wait. If streams "
                f"stall while long prompts are admitted, set SPLITFLASH_VERIFY_PREFILL_CHUNK_MS",
            )
    return None
