"""Short prompts that arrive together share one prefill forward on the verify server.

Over real sockets (verify in a thread, the tiny random target, forwards slowed so that
messages queue): four short Prefills sent while a long prompt's chunk runs are answered
from ONE forward holding all four, the long prompt keeps forwards of its own, and every
request then decodes as target-only decoding says. With a time budget set and a request
decoding, a forward takes along only the prompts its budget has room for. A packed forward
that fails takes no prompt down: each runs alone, and only the one that cannot run fails.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from splitflash.protocol import PrefillReply, Verify
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.verify.chunk_sizer import ChunkSizer
from tests.integration.test_prefill_interleaving import (
    LONG,
    Pipe,
    _collect,
    _job,
    prefill,
    step,
    target_only,
    verify_server,
    with_gateway,
)
from tests.integration.workers_harness import running

pytestmark = pytest.mark.timeout(120)
SHORTS = {f"s{i}": [(i * 7 + j * 3) % 90 + 1 for j in range(5 + 4 * i)] for i in range(4)}


def record_forwards(server, pause_s: float, slow_first_s: float = 0.0,
                    fails_with: int | None = None) -> list[list[int]]:  # fmt: skip
    """The q_lens of every forward of the server's target, each slowed by pause_s (the
    first by slow_first_s more); a forward holding a chunk of fails_with tokens raises."""
    seen: list[list[int]] = []
    forward = server.engine.model.forward

    def recorded(batch, *args, **kwargs):
        seen.append(list(batch.meta.q_lens))
        time.sleep(pause_s + (slow_first_s if len(seen) == 1 else 0.0))
        if fails_with in seen[-1]:
            raise RuntimeError("CUDA out of memory (injected)")
        return forward(batch, *args, **kwargs)

    server.engine.model.forward = recorded
    return seen


def _prefill_all(v, pipe) -> dict[str, list[int]]:
    """LONG, then the short prompts at once; each request's prefill token + 3 steps."""
    calls = {pipe.send(prefill("long", LONG)): "long"}
    calls |= {pipe.send(prefill(rid, p)): rid for rid, p in SHORTS.items()}
    out = {}
    for _ in calls:
        call, reply = pipe.reply()
        assert isinstance(reply, PrefillReply) and reply.results[0].error is None
        out[calls[call]] = list(reply.results[0].committed_ids)
    for rid, prompt in {**SHORTS, "long": LONG}.items():
        for _ in range(3):
            pipe.send(step(rid, len(prompt) + len(out[rid])))
            out[rid] += pipe.reply()[1].results[0].committed_ids
    return out


def test_short_prompts_sent_together_share_one_forward():
    with running(verify_server(chunk=64)) as v:
        forwards = record_forwards(v, 0.05)  # LONG's first chunk: the shorts all arrive
        pipe = Pipe(v.endpoint)
        try:
            out = _prefill_all(v, pipe)
        finally:
            pipe.close()
    short_lens = sorted(len(p) for p in SHORTS.values())
    packed = [f for f in forwards if sorted(f) == short_lens]
    assert len(packed) == 1, forwards  # all four in one forward, none alone
    assert not [f for f in forwards if len(f) == 1 and f[0] in short_lens[:-1]], forwards
    long_chunks = [f for f in forwards if 64 in f]
    assert long_chunks and all(f == [64] for f in long_chunks)  # never packed: it fills them
    for rid, prompt in {**SHORTS, "long": LONG}.items():
        assert out[rid] == target_only(prompt, 4), rid


def test_a_failed_packed_forward_fails_only_the_prompt_that_cannot_run():
    """s3's chunk always fails (out of memory, say): the forward packing all four shorts
    fails, each then runs alone, s0-s2 answer as target-only decoding says, s3 answers an
    error naming the cause, and no page is left behind."""
    live = ["long", "s0", "s1", "s2"]
    with running(verify_server(chunk=64)) as v:
        forwards = record_forwards(v, 0.05, fails_with=len(SHORTS["s3"]))
        pipe = Pipe(v.endpoint)
        try:
            calls = {pipe.send(prefill("long", LONG[:64])): "long"}  # its forward: all arrive
            calls |= {pipe.send(prefill(rid, p)): rid for rid, p in SHORTS.items()}
            results = {calls[c]: r.results[0] for c, r in (pipe.reply() for _ in calls)}
            cache = v.engine.cache  # the loop is idle: every reply is in
            held = set(cache.seqs), cache.used_pages, sum(len(cache.seq(r).pages) for r in live)
        finally:
            pipe.close()
    short_lens = [len(SHORTS[r]) for r in ("s0", "s1", "s2", "s3")]
    assert forwards[0] == [64] and sorted(forwards[1]) == short_lens, forwards
    assert sorted(forwards[2:]) == [[n] for n in short_lens], forwards  # each alone once
    assert "CUDA out of memory (injected)" in results["s3"].error
    for rid in ("s0", "s1", "s2"):
        assert results[rid].error is None, rid
        assert list(results[rid].committed_ids) == target_only(SHORTS[rid], 1), rid
    assert results["long"].error is None
    assert held[0] == set(live) and held[1] == held[2], held  # s3 left no page behind


def test_over_the_wire_a_prompt_outside_the_vocabulary_fails_alone_and_a_draft_is_cut():
    """A Prefill holding a token id past the target's vocabulary: that request's result
    names the token, the others prefill as target-only says; a Verify whose drafts hold
    such an id commits what target-only decoding does, and is counted."""
    with running(verify_server(chunk=64)) as v:
        vocab = v.engine.model.cfg.vocab_size
        want = target_only(SHORTS["s1"], 3)
        pipe = Pipe(v.endpoint)
        try:
            calls = {pipe.send(prefill("bad", [5, 6, vocab + 3, 7])): "bad",
                     pipe.send(prefill("s1", SHORTS["s1"])): "s1"}  # fmt: skip
            results = {calls[c]: r.results[0] for c, r in (pipe.reply() for _ in calls)}
            item = step("s1", len(SHORTS["s1"]) + 1).items[0]
            drafts = [want[1], vocab, want[2]]
            pipe.send(Verify(items=[msgspec.structs.replace(item, draft_ids=drafts)]))
            after = pipe.reply()[1].results[0]
            held = set(v.engine.cache.seqs)  # the loop is idle: every reply is in
            cut = v.metrics.registry.get_sample_value(
                "splitflash_verify_drafts_outside_vocabulary_total"
            )
        finally:
            pipe.close()
    assert f"prompt token 2 is id {vocab + 3}, outside the target's vocabulary" in (
        results["bad"].error
    )
    assert list(results["s1"].committed_ids) == want[:1]
    assert after.error is None and list(after.committed_ids) == want[1:3]
    assert held == {"s1"} and cut == 1.0  # the alert DraftsOutsideTargetVocabulary's counter


class SyntheticSizer(ChunkSizer):
    """Observes each forward's synthetic cost (so its fit is exact) instead of wall time."""

    def observe_pack(self, chunks: list[tuple[int, int]], seconds: float) -> None:
        super().observe_pack(chunks, sum(cost(n, c) for n, c in chunks))


def cost(n: int, c: int) -> float:
    """Synthetic seconds of n prompt tokens after c cached: 5 / 9 / 13 / 17 tokens at 0
    cost 6.25 / 13.05 / 21.45 / 31.45 ms."""
    return 1e-3 * n + 1e-4 * n * (c + n / 2)


def test_with_a_time_budget_and_a_request_decoding_partners_fit_the_budget():
    """Budget 35 ms: s0 (6.25) takes s1 (13.05) along, 15.7 ms left is too little for s2
    (21.45) or s3 (31.45); s2 then leaves too little for s3."""
    with running(verify_server(chunk=64)) as v:
        v.chunk_sizer = sizer = SyntheticSizer(0.035, 64)
        for c in (0, 1000):  # two context-to-size ratios: the fit is exact from the start
            sizer.observe(64, c, 0.0)
        pipe = Pipe(v.endpoint)
        try:
            pipe.send(prefill("long", LONG[:20]))  # decoding from here on
            long_out = list(pipe.reply()[1].results[0].committed_ids)
            forwards = record_forwards(v, 0.05)  # the step's forward: the shorts all arrive
            pipe.send(step("long", 20 + len(long_out)))
            calls = {pipe.send(prefill(rid, p)): rid for rid, p in SHORTS.items()}
            replies = [pipe.reply() for _ in range(len(calls) + 1)]
        finally:
            pipe.close()
    out = {calls[c]: list(r.results[0].committed_ids) for c, r in replies if c in calls}
    assert forwards == [[1], [5, 9], [13], [17]], forwards
    for rid, prompt in SHORTS.items():
        assert out[rid] == target_only(prompt, 1), rid


def test_requests_admitted_together_through_the_gateway_share_a_prefill_forward():
    """The gateway sends one Prefill per request; those that reach the worker during one
    forward are all served before the next slice, so the first of them takes the rest."""
    with running(verify_server(chunk=64)) as v:
        forwards = record_forwards(v, 0.0, slow_first_s=0.3)
        settings = GatewaySettings(verify_addr=v.endpoint, draft_addr="")

        async def go(runtime):
            first = _job("first", SHORTS["s0"], 2)  # its prefill forward: 0.3 s
            runtime.orchestrator.submit(first)
            await asyncio.sleep(0.1)
            jobs = [_job(rid, p, 3) for rid, p in SHORTS.items() if rid != "s0"]
            for job in jobs:
                runtime.orchestrator.submit(job)  # no await between: one admission batch
            outs = await asyncio.gather(*(_collect(j, []) for j in [first, *jobs]))
            return dict(zip(["first", *[j.request_id for j in jobs]], outs, strict=True))

        out = with_gateway(settings, go)
    lens = sorted(len(SHORTS[r]) for r in ("s1", "s2", "s3"))
    assert forwards[0] == [len(SHORTS["s0"])]
    assert [sorted(f) for f in forwards].count(lens) == 1, forwards
    assert not [f for f in forwards if len(f) == 1 and f[0] in lens], forwards  # none alone
    assert out["first"] == target_only(SHORTS["s0"], 2)
    for rid in ("s1", "s2", "s3"):
        assert out[rid] == target_only(SHORTS[rid], 3), rid
