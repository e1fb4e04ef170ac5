"""Pure helpers of the verify server: per-item checks and engine reports -> wire results.

No sockets, no metrics: plain functions over the engine's state and messages, and the
engine's description its Hello replies carry.
"""

from __future__ import annotations

from splitflash.models.graphs import graphs_summary
from splitflash.protocol import StepResult, VerifyItem
from splitflash.services.verify.engine import StepReport, TargetEngine


def error_result(request_id: str, base_len: int, error: str) -> StepResult:
    """A failed item: nothing committed; base_len = verify's own committed length (0 if none)."""
    return StepResult(
        request_id=request_id, committed_ids=[], commit_len=0, base_len=base_len, error=error
    )


def committed_len(engine: TargetEngine, request_id: str) -> int:
    seq = engine.seqs.get(request_id)
    return 0 if seq is None else len(seq.tokens)


def verify_precheck(engine: TargetEngine, item: VerifyItem, now: float) -> str | None:
    """Why this item cannot run, checked before the batch so one bad item fails alone.

    The error text starts with the ErrorCode it stands for ("deadline", "desync" ...).
    """
    rid = item.request_id
    if now > item.deadline:
        return "deadline: passed before verify"
    seq = engine.seqs.get(rid)
    if seq is None:
        return f"unknown_request: {rid!r} is not open on verify (prefilled? released?)"
    if item.base_len != len(seq.tokens):
        return (
            f"desync: gateway says base_len {item.base_len}, verify has "
            f"{len(seq.tokens)} committed tokens for {rid!r}"
        )
    if item.base_len >= engine.max_context:
        return f"context full: {item.base_len} tokens, max_context {engine.max_context}"
    return None


def step_result(engine: TargetEngine, report: StepReport, stop_ids: frozenset[int]) -> StepResult:
    rid = report.request_id
    if report.error is not None or report.outcome is None:
        return error_result(rid, committed_len(engine, rid), report.error or "no outcome")
    o = report.outcome
    reason = None
    if report.finished:
        reason = "stop" if o.committed and o.committed[-1] in stop_ids else "length"
    return StepResult(
        request_id=rid,
        committed_ids=list(o.committed),
        commit_len=o.commit_len,
        accepted_drafts=o.accepted_drafts,
        accepted_depth=o.accepted_depth,
        draft_tokens=o.draft_tokens,
        base_len=report.committed_len,
        finished_reason=reason,
    )


def bytes_read(engine: TargetEngine, base_lens: list[int], weight_bytes: int) -> int:
    """KV bytes a verify batch's attention read plus the weights read once per forward."""
    kv = engine.cache.k  # [L, P, S, H_KV, D]; K and V both read
    per_token = 2 * kv.shape[0] * kv.shape[3] * kv.shape[4] * kv.element_size()
    return sum(base_lens) * per_token + weight_bytes


def describe_engine(engine: TargetEngine, metrics_port: int) -> dict[str, str]:
    """What the verify service runs on, for its start-up log and its Hello replies."""
    e = engine
    page_tokens = e.cache.num_pages * e.cache.page_size
    graphs = getattr(e, "graphs", None)  # None: eager steps (CPU, graphs off, TP)
    return {
        "device": str(e.device),
        "dtype": str(e.model.embed_tokens.weight.dtype).removeprefix("torch."),
        "attention_backend": e.model.backend.name,
        "kv_pool": f"{e.cache.num_pages} pages x {e.cache.page_size} = {page_tokens} tokens",
        "max_context": str(e.max_context),
        "cuda_graphs": graphs_summary(graphs),
        # the gateway warns when it batches more requests than this (0 = no graphs)
        "graph_max_batch": str(max(graphs.batch_sizes) if graphs else 0),
        "metrics_port": str(metrics_port),  # doctor finds /metrics by it
    }
