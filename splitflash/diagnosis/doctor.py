"""`splitflash doctor`'s measurement run: requests at each context -> rows -> findings.

Requests run one at a time, so the worker counters' increases between two scrapes belong to
that context's requests alone (keys read per draft, bytes read per step). Doctor assumes
no other traffic on the deployment while it runs; the gateway counters it reports are
increases over the run (other traffic would inflate them, and the JSON says so).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from splitflash.diagnosis.findings import Finding, PolicyInfo, parse_policy
from splitflash.diagnosis.probe import DoctorError, Gateway, metrics_url, prompt_for, scrape
from splitflash.diagnosis.rows import Samples, by_label, delta, summarise, total, worker_figures
from splitflash.diagnosis.rules import diagnose

GATEWAY_COUNTERS = {
    "steps": "splitflash_spec_verify_steps_total",
    "draft_tokens": "splitflash_spec_draft_tokens_total",
    "accepted_drafts": "splitflash_spec_accepted_tokens_total",
    "generated_tokens": "splitflash_generated_tokens_total",
}
VIOLATIONS = "splitflash_spec_invariant_violations_total"


@dataclass
class DoctorReport:
    url: str
    model: str
    policy: PolicyInfo
    rows: list[dict] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {context, reason}
    violations: dict[str, float] = field(default_factory=dict)
    gateway_counters: dict[str, float] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what doctor could not look at, and why
    verify_info: dict = field(default_factory=dict)  # /ready's verify.info: device, graphs...

    def to_dict(self) -> dict:
        return {
            "url": self.url,
            "model": self.model,
            "policy": self.policy.to_dict(),
            "rows": self.rows,
            "skipped": self.skipped,
            "invariant_violations": self.violations,
            "gateway_counter_increases": self.gateway_counters,
            "findings": [f.to_dict() for f in self.findings],
            "notes": self.notes,
            "verify_info": self.verify_info,
            "healthy": not self.findings,
        }


def read_policy(ready: dict, draft: Samples | None) -> PolicyInfo:
    """The drafter's policy from /ready's draft.info, plus the draft metrics when given."""
    info = (ready.get("draft") or {}).get("info") or {}
    mismatch = bound = None
    if draft is not None:
        mismatch = total(draft, "splitflash_draft_attention_policy_mismatch") >= 1
        bound = total(draft, "splitflash_draft_sliding_keys_bound")
    return parse_policy(str(info.get("drafter", "")), str(info.get("policy", "")), mismatch, bound)


def run_doctor(
    url: str,
    contexts: Sequence[int],
    max_tokens: int = 64,
    repeats: int = 1,
    draft_metrics: str | None = None,
    verify_metrics: str | None = None,
    on_progress: Callable[[str], None] = lambda _: None,
) -> DoctorReport:
    """Measure every context in turn; DoctorError when nothing could be measured."""
    if not contexts or min(contexts) < 1 or max_tokens < 2 or repeats < 1:
        raise ValueError("contexts must be >= 1, --max-tokens >= 2 and repeats >= 1")
    gw = Gateway(url)
    try:
        ready = gw.ready()
        model = gw.model()
        notes: list[str] = []
        draft_metrics = draft_metrics or _discover(ready, "draft", notes)
        verify_metrics = verify_metrics or _discover(ready, "verify", notes)
        verify_info = dict((ready.get("verify") or {}).get("info") or {})
        policy = read_policy(ready, _maybe(draft_metrics))
        report = DoctorReport(url, model, policy, notes=notes, verify_info=verify_info)
        gw_before = gw.metrics()
        on_progress("calibrating prompt length")
        per, fixed = gw.calibrate(model)
        gw.stream(model, prompt_for(64, per, fixed), 8)  # warm-up: first decode steps cost more
        for context in contexts:
            on_progress(f"context {context}")
            _measure(gw, model, report, context, per, fixed, max_tokens, repeats,
                     draft_metrics, verify_metrics)  # fmt: skip
        gw_after = gw.metrics()
    finally:
        gw.close()
    if not report.rows:
        reasons = "; ".join(f"{s['context']}: {s['reason']}" for s in report.skipped)
        raise DoctorError(f"no context could be measured ({reasons})")
    before = by_label(gw_before, VIOLATIONS, "invariant")
    report.violations = {
        k: v - before.get(k, 0.0) for k, v in by_label(gw_after, VIOLATIONS, "invariant").items()
    }
    report.gateway_counters = {
        k: delta(gw_after, gw_before, name) for k, name in GATEWAY_COUNTERS.items()
    }
    report.findings = diagnose(report.rows, report.policy, report.violations)
    return report


def _maybe(url: str | None) -> Samples | None:
    return scrape(url) if url else None


def _discover(ready: dict, role: str, notes: list[str]) -> str | None:
    """A worker's /metrics URL from /ready when it answers; else a note saying why not and
    which option gives it (the figures and findings that need it are then left out)."""
    if not ready.get(role):
        return None  # no such service (no drafter): nothing to say
    url, why = metrics_url(ready, role)
    if url is not None and scrape(url) is None:
        url, why = None, f"{role} metrics at {url} do not answer"
    if url is None:
        notes.append(f"{role} worker metrics not read ({why}): pass --{role}-metrics URL")
    return url


PAUSED = ("splitflash_spec_fallback_steps_total", {"reason": "unprofitable"})


def _measure(gw, model, report, context, per, fixed, max_tokens, repeats, d_url, v_url) -> None:
    d0, v0, g0 = _maybe(d_url), _maybe(v_url), gw.metrics()
    try:
        done = [gw.stream(model, prompt_for(context, per, fixed), max_tokens)]
        done += [gw.stream(model, prompt_for(context, per, fixed), max_tokens)
                 for _ in range(repeats - 1)]  # fmt: skip
    except DoctorError as e:
        report.skipped.append({"context": context, "reason": str(e)})
        return
    d1, v1, g1 = _maybe(d_url), _maybe(v_url), gw.metrics()
    row = summarise(done)
    row["requested_context"] = context
    if row["steps"]:  # request-steps the speculation gate ran without drafts
        row["paused_fraction"] = delta(g1, g0, PAUSED[0], **PAUSED[1]) / row["steps"]
    row.update(
        worker_figures(
            (d0, d1) if d0 is not None and d1 is not None else None,
            (v0, v1) if v0 is not None and v1 is not None else None,
            row["steps"],
        )
    )
    report.rows.append(row)
