"""Driving a TargetEngine through prefill and verify steps whose drafts are cut from a known
greedy output (some made wrong on purpose): shared by the tensor-parallel tests, which compare
what several engines commit for the same steps."""

from __future__ import annotations

from splitflash.services.verify.engine import TargetEngine, VerifyInput
from splitflash.services.verify.sampling import Sampling


def greedy_oracle(engine: TargetEngine, prompts: dict[str, list[int]], new_tokens: int) -> dict:
    """Target-only greedy (no drafts) of every prompt, new_tokens tokens each; the requests
    stay open in `engine`."""
    for rid, prompt in prompts.items():
        engine.prefill(rid, prompt, Sampling(), (), 10_000)
    for _ in range(new_tokens - 1):
        engine.verify([VerifyInput(r, len(engine.seqs[r].tokens), [], 10_000) for r in prompts])
    return {rid: engine.seqs[rid].tokens for rid in prompts}


def steps_with_drafts(
    engine: TargetEngine,
    prompts: dict[str, list[int]],
    oracle: dict[str, list[int]],
    draft_lens: tuple[int, ...],
) -> list:
    """Prefill every prompt of `oracle`, then one verify step per entry of draft_lens with that
    many drafts cut from the oracle (odd steps: one wrong) -> [(rid, committed, features)]."""
    vocab = engine.model.cfg.vocab_size
    records = []
    for rid in oracle:
        rep = engine.prefill(rid, prompts[rid], Sampling(), (), 10_000)
        records.append((rid, rep.outcome.committed, rep.features))
    for step, k in enumerate(draft_lens):
        items = []
        for rid, seq in engine.seqs.items():
            n = len(seq.tokens)
            drafts = list(oracle[rid][n : n + k])
            if step % 2 and drafts:
                drafts[len(drafts) // 2] = (drafts[len(drafts) // 2] + 1) % vocab
            items.append(VerifyInput(rid, n, drafts, 10_000))
        for rep in engine.verify(items):
            assert rep.error is None and not rep.violations
            records.append((rep.request_id, rep.outcome.committed, rep.features))
    return records
