"""Prompt chunks sized to a time budget while other requests decode (prefill_chunk_ms).

Over real sockets (verify in a thread, the tiny random target): the verify server's
ChunkSizer here observes a synthetic cost of each chunk instead of its wall time, so the
sizes are a function of the prompt alone. Checked: chunks shrink as the prompt's context
grows and each costs at most the budget; with no request decoding they stay full size;
the output is target-only decoding's whatever the chunking.
"""

from __future__ import annotations

import pytest

from splitflash.protocol import PrefillReply
from splitflash.services.verify.chunk_sizer import ChunkSizer
from tests.integration.test_prefill_interleaving import (
    LONG,
    SHORT,
    Pipe,
    prefill,
    step,
    target_only,
    verify_server,
)
from tests.integration.workers_harness import running

pytestmark = pytest.mark.timeout(120)
BUDGET_S, FULL = 0.5, 64


def cost(n: int, c: int) -> float:
    """Synthetic seconds of a chunk of n tokens after c cached: 64 at 0 cost 0.27, at 300 2.2."""
    return 1e-3 * n + 1e-4 * n * (c + n / 2)


class SyntheticSizer(ChunkSizer):
    def __init__(self) -> None:
        super().__init__(BUDGET_S, FULL, min_tokens=4)
        self.chunks: list[tuple[int, int]] = []  # (tokens, cached) of every chunk run

    def observe_pack(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        self.chunks += chunks
        super().observe_pack(chunks, sum(cost(n, c) for n, c in chunks))


def _prefill_long(with_stream: bool) -> tuple[SyntheticSizer, list[int], list[int]]:
    """(the sizer, the sizes of LONG's chunks, LONG's first 6 tokens)."""
    # LONG prefilled with SHORT decoding beside it (or alone), then 5 plain steps of LONG.
    with running(verify_server(chunk=FULL)) as v:
        v.chunk_sizer = sizer = SyntheticSizer()
        pipe = Pipe(v.endpoint)
        outs = {}
        prompts = ([("short", SHORT)] if with_stream else []) + [("long", LONG)]
        try:
            for rid, prompt in prompts:
                pipe.send(prefill(rid, prompt))
                _, reply = pipe.reply()
                assert isinstance(reply, PrefillReply) and reply.results[0].error is None
                outs[rid] = list(reply.results[0].committed_ids)
            for _ in range(5):
                pipe.send(step("long", len(LONG) + len(outs["long"])))
                _, msg = pipe.reply()
                outs["long"] += msg.results[0].committed_ids
        finally:
            pipe.close()
    long_chunks = [n for n, _ in sizer.chunks[1 if with_stream else 0 :]]  # SHORT: 1 chunk
    return sizer, long_chunks, outs["long"]


def test_chunks_shrink_to_the_budget_while_another_request_decodes():
    sizer, sizes, long_out = _prefill_long(with_stream=True)
    assert sum(sizes) == len(LONG)
    cached = [sum(sizes[:i]) for i in range(len(sizes))]
    costs = [cost(n, c) for n, c in zip(sizes, cached, strict=True)]
    assert max(costs) <= BUDGET_S, costs  # n is floored: at most the budget
    # and no smaller than needed once SHORT's chunk and LONG's first pin both terms
    assert min(costs[1:-1]) >= BUDGET_S * 0.9, costs
    assert sizes[0] > 2 * sizes[-2]  # ~57 at the start (one-term fit), ~18 at 380 keys
    assert long_out == target_only(LONG, 6)


def test_chunks_stay_full_when_no_request_waits_for_them():
    _, sizes, long_out = _prefill_long(with_stream=False)
    assert sizes == [FULL] * (len(LONG) // FULL) + [len(LONG) % FULL]
    assert long_out == target_only(LONG, 6)
