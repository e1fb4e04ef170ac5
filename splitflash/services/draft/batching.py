"""Drafting a Propose batch: one batched drafter call per distinct k where the drafter can.

Pure over the drafter object (no sockets, no metrics), so it is tested without a server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

Outcome = list[int] | Exception  # the drafted chain, or why this request got none


def propose_all(drafter: Any, ready: Sequence[tuple[str, int]]) -> dict[str, Outcome]:
    """Drafts for (request_id, k) pairs, k >= 1.

    With `propose_batch(request_ids, k)` (DFlash: one forward for the batch) requests sharing
    a k are drafted together; a failing batch is retried one by one, so one request that
    cannot draft (e.g. its features are missing) fails alone instead of failing the batch.
    """
    out: dict[str, Outcome] = {}
    batch = getattr(drafter, "propose_batch", None)
    if callable(batch) and len(ready) > 1:
        by_k: dict[int, list[str]] = {}
        for rid, k in ready:
            by_k.setdefault(k, []).append(rid)
        for k, rids in by_k.items():
            try:
                chains = batch(rids, k)
            except Exception as e:
                log.info(
                    "batched draft of %d requests failed (%s); drafting one by one", len(rids), e
                )
                continue
            out.update(zip(rids, ([int(t) for t in c][:k] for c in chains), strict=True))
    for rid, k in ready:
        if rid in out:
            continue
        try:
            out[rid] = [int(t) for t in drafter.propose(rid, k)][:k]
        except Exception as e:  # drafter refused: no drafts for this request this step
            out[rid] = e
    return out
