"""Start-up warm-up of the DFlash proposer: its kernels compile before the first request.

A process's first draft step of a shape compiles its Triton kernels and captures a CUDA
graph. Measured on an H100 (`python -m bench.first_step`, bench/RESULTS.md "Session 24"):
the first draft step of a process took 1.3 s, the first past the sliding window 0.66 s (12 s
and 5 s while the drafter's attention still autotuned). A throwaway request goes through
the proposer's own calls here, as the draft service makes them, at each warm-up context: a
prompt's features written eagerly and a draft, then a verify step's features written by the
draft graph and a draft. Its pool slot is handed back, and the metrics' counters are reset,
so they count only what serving does.
"""

from __future__ import annotations

import logging
import time
import uuid

import torch

from splitflash.services.draft.dflash_drafter import DFlashProposer

log = logging.getLogger(__name__)

# Inside the shipped drafter's 512-key window, past it (its sliding layers read a full
# window, its full layer splits the context over several programs) and at the most splits a
# batch-1 launch plans (the split combine specialises on the count's power of two; see
# services/verify/warmup.py). Contexts past the pool's rows are left out.
WARM_CONTEXTS = (300, 3000, 20000)


def warm_up(proposer: DFlashProposer, contexts: tuple[int, ...] = WARM_CONTEXTS) -> float:
    """One request per context: prompt features + a draft, one step's features + a draft.
    Contexts the pool cannot hold are left out. Returns the seconds taken."""
    t0 = time.perf_counter()
    drafter = proposer.drafter
    block, k = drafter.config.block_size, proposer.max_drafts
    room = proposer.pool.context if proposer.pool is not None else max(contexts) + 2 * block
    weight = drafter.fc.weight

    def features(n: int) -> torch.Tensor:  # [n, K*D] of zeros: what they hold is not timed
        return torch.zeros(n, drafter.config.feature_dim, device=weight.device,
                           dtype=weight.dtype)  # fmt: skip

    for ctx in (c for c in contexts if c + 2 * block <= room):
        rid = f"warmup-{uuid.uuid4().hex}"  # never a client's id: the gateway names requests
        proposer.open(rid, [0] * (ctx + 1))
        try:
            proposer.add_features(rid, 0, features(ctx))
            proposer.propose(rid, k)
            proposer.extend(rid, [0] * block, ctx + 1 + block)
            proposer.add_features(rid, ctx, features(block))
            proposer.propose(rid, k)
        finally:
            proposer.release(rid)
        log.info("draft warm-up: context %d (%.1f s)", ctx, time.perf_counter() - t0)
    captures, seconds = proposer.pop_capture_stats()
    proposer.pop_forwards()
    proposer.pop_keys_read()
    log.info("draft warm-up captured %d graphs in %.1f s", captures, seconds)
    if weight.is_cuda:
        torch.cuda.synchronize(weight.device)
    return time.perf_counter() - t0
