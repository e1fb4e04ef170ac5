"""A long prompt is prefilled a chunk at a time BETWEEN the other requests' steps.

Over real sockets (servers in threads, the tiny random target):
- verify answers a running request's Verify while a Prefill is still running its chunks,
  and both come out as target-only decoding with a whole-prompt prefill says;
- a Release or a deadline that catches a prompt mid-prefill ends it with an error and
  frees its pages, and the request can be prefilled again;
- through the gateway, a stream goes on while another request's long prompt prefills.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from splitflash.local import generate_local
from splitflash.protocol import (
    VERIFY_REQUESTS,
    VERIFY_RESPONSES,
    Prefill,
    PrefillItem,
    PrefillReply,
    Release,
    ReleaseReply,
    Verify,
    VerifyItem,
    VerifyReply,
    dealer_send,
    recv,
)
from splitflash.services.common.metric_math import context_bucket
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.jobs import Failed, Finished, Job, Tokens
from splitflash.services.gateway.runtime import GatewayRuntime
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.server import VerifyServer
from tests.conftest import tiny_engine, tiny_model
from tests.integration.workers_harness import CALL_S, deadline, running

pytestmark = pytest.mark.timeout(120)
ANY_PORT = "tcp://127.0.0.1:*"
SHORT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
LONG = [(i * 37 + 11) % 97 for i in range(400)]  # 200 chunks of 2
CHUNK = 2


def verify_server(chunk: int = CHUNK) -> VerifyServer:
    settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr="", prefill_chunk=chunk)
    engine = tiny_engine(tiny_model(), pages=256)
    engine.prefill_chunk = chunk
    return VerifyServer(settings, engine=engine, model_name="tiny")


def before_each_forward(server: VerifyServer, hook) -> None:
    """Run hook() before every forward of the server's target (a slow or counted chunk)."""
    forward = server.engine.model.forward

    def hooked(*args, **kwargs):
        hook()
        return forward(*args, **kwargs)

    server.engine.model.forward = hooked


def target_only(prompt: list[int], n: int) -> list[int]:
    """Reference: one whole-prompt forward, then plain decoding."""
    return generate_local(tiny_engine(tiny_model(), pages=256), None, prompt, n).token_ids


class Pipe:
    """A DEALER that sends without waiting and matches replies by call id."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)
        self.calls = 0

    def send(self, msg) -> int:
        self.calls += 1
        dealer_send(self.sock, self.calls.to_bytes(8, "big"), msg, VERIFY_REQUESTS,
                    timeout_ms=int(CALL_S * 1000))  # fmt: skip
        return self.calls

    def reply(self):
        inc = recv(self.sock, VERIFY_RESPONSES, router=False, timeout_ms=int(CALL_S * 1000))
        return int.from_bytes(inc.call_id, "big"), inc.msg

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


def prefill(rid: str, prompt: list[int], until: float | None = None) -> Prefill:
    return Prefill(items=[PrefillItem(request_id=rid, deadline=until or deadline(),
                                      prompt_ids=prompt)])  # fmt: skip


def step(rid: str, base_len: int) -> Verify:
    item = VerifyItem(request_id=rid, deadline=deadline(), base_len=base_len, draft_ids=[],
                      max_commit=100)  # fmt: skip
    return Verify(items=[item])


def test_running_requests_step_while_a_long_prompt_prefills():
    with running(verify_server()) as v:
        pipe = Pipe(v.endpoint)
        try:
            pipe.send(prefill("short", SHORT))
            _, first = pipe.reply()
            short = list(first.results[0].committed_ids)
            long_call = pipe.send(prefill("long", LONG))
            steps_meanwhile = 0
            while True:  # one plain step of "short" at a time until the prefill answers
                pipe.send(step("short", len(SHORT) + len(short)))
                call, msg = pipe.reply()
                if call == long_call:
                    long_first = msg
                    pipe.reply()  # the step sent last
                    break
                assert isinstance(msg, VerifyReply) and msg.results[0].error is None
                short += msg.results[0].committed_ids
                steps_meanwhile += 1
            # (each step waits for ONE chunk at most: 200 chunks leave room for many)
            assert steps_meanwhile >= 10, steps_meanwhile
            assert isinstance(long_first, PrefillReply) and long_first.results[0].error is None
            long = list(long_first.results[0].committed_ids)
            for _ in range(5):
                pipe.send(step("long", len(LONG) + len(long)))
                _, msg = pipe.reply()
                long += msg.results[0].committed_ids
        finally:
            pipe.close()
        assert short == target_only(SHORT, len(short))
        assert long == target_only(LONG, 6)


def test_a_release_mid_prefill_stops_it_and_frees_its_pages():
    with running(verify_server(chunk=1)) as v:
        pipe = Pipe(v.endpoint)
        try:
            prefill_call = pipe.send(prefill("long", LONG))
            release_call = pipe.send(Release(request_ids=["long"]))
            replies = dict(pipe.reply() for _ in range(2))
            assert replies[release_call] == ReleaseReply(released=["long"])
            (result,) = replies[prefill_call].results
            assert result.error == "released before its prefill finished"
            assert result.committed_ids == []
            assert v.engine.cache.used_pages == 0 and "long" not in v.engine.cache.seqs
            pipe.send(prefill("long", LONG[:40]))  # the id is free again
            _, again = pipe.reply()
            assert again.results[0].committed_ids == target_only(LONG[:40], 1)
        finally:
            pipe.close()


def test_a_deadline_passing_between_chunks_ends_the_prefill():
    with running(verify_server(chunk=1)) as v:
        before_each_forward(v, lambda: time.sleep(0.005))  # 400 chunks x 5 ms: past the deadline
        pipe = Pipe(v.endpoint)
        try:
            pipe.send(prefill("late", LONG, until=time.time() + 0.3))
            _, reply = pipe.reply()
        finally:
            pipe.close()
        (result,) = reply.results
        assert result.error.startswith("deadline: passed during prefill ("), result.error
        done = int(result.error.split("(")[1].split()[0])
        assert 0 < done < len(LONG)
        assert v.engine.cache.used_pages == 0 and "late" not in v.engine.cache.seqs


def test_each_prefill_chunk_is_timed_by_the_context_it_reaches():
    """splitflash_verify_prefill_chunk_seconds: one observation per chunk, each at least its
    forward's time (slowed here), labelled by the bucket of the chunk's last position."""
    with running(verify_server(chunk=8)) as v:
        before_each_forward(v, lambda: time.sleep(0.02))
        pipe = Pipe(v.endpoint)
        try:
            pipe.send(prefill("timed", LONG[:40]))  # 5 chunks of 8
            _, reply = pipe.reply()
        finally:
            pipe.close()
        assert reply.results[0].error is None
        labels = {"context_bucket": context_bucket(40)}
        sample = v.metrics.registry.get_sample_value
        name = "splitflash_verify_prefill_chunk_seconds"
        assert sample(name + "_count", labels) == 5
        assert 5 * 0.02 <= sample(name + "_sum", labels) < reply.timings["total"]


def with_gateway(settings: GatewaySettings, body):
    """What `await body(runtime)` gives on a gateway runtime started for it, stopped after."""

    async def go():
        runtime = GatewayRuntime(settings, tokenizer=None)
        await runtime.start()
        try:
            return await body(runtime)
        finally:
            await runtime.stop()

    return asyncio.run(go())


def _job(rid: str, prompt: list[int], n: int) -> Job:
    return Job(request_id=rid, prompt_ids=list(prompt), max_tokens=n, temperature=0.0,
               top_p=1.0, top_k=0, seed=None, spec_enabled=False, block_size=4)  # fmt: skip


async def _collect(job: Job, arrivals: list[tuple[float, str, int]]) -> list[int]:
    ids: list[int] = []
    while True:
        event = await asyncio.wait_for(job.events.get(), timeout=CALL_S)
        if isinstance(event, Tokens):
            ids += event.ids
            arrivals.append((time.monotonic(), job.request_id, len(event.ids)))
        elif isinstance(event, Finished):
            return ids
        elif isinstance(event, Failed):
            raise AssertionError(f"{job.request_id} failed: {event}")


def test_the_gateway_keeps_streaming_while_a_long_prompt_prefills():
    with running(verify_server()) as v:
        settings = GatewaySettings(verify_addr=v.endpoint, draft_addr="")

        async def go(runtime):
            arrivals: list[tuple[float, str, int]] = []
            stream = _job("stream", SHORT, 60)
            runtime.orchestrator.submit(stream)
            streaming = asyncio.create_task(_collect(stream, arrivals))
            while not arrivals:  # the stream has started
                await asyncio.sleep(0.005)
            late = _job("late", LONG, 4)
            submitted = time.monotonic()
            runtime.orchestrator.submit(late)
            seen = []  # /ready's counts while the long prompt prefills
            for _ in range(1000):  # bounded: until its Prefill is sent
                if runtime.orchestrator.prefilling:
                    status = runtime.status()
                    seen.append((status["prefilling"], status["running"]))
                    break
                await asyncio.sleep(0.001)
            outs = await asyncio.gather(streaming, _collect(late, arrivals))
            return outs, arrivals, submitted, seen

        (stream_ids, late_ids), arrivals, submitted, seen = with_gateway(settings, go)
    assert seen == [(1, 1)]  # the long prompt prefilling, the stream running
    late_first = min(t for t, rid, _ in arrivals if rid == "late")
    meanwhile = sum(n for t, rid, n in arrivals if rid == "stream" and submitted < t < late_first)
    # The old admission awaited the Prefill before the next step: nothing streamed meanwhile.
    assert meanwhile >= 10, meanwhile
    assert stream_ids == target_only(SHORT, 60)
    assert late_ids == target_only(LONG, 4)


def test_a_request_cancelled_while_prefilling_stops_its_prefill_and_frees_its_pages():
    with running(verify_server(chunk=1)) as v:
        chunks: list[int] = []
        before_each_forward(v, lambda: chunks.append(1))
        settings = GatewaySettings(verify_addr=v.endpoint, draft_addr="")

        async def go(runtime):
            job = _job("gone", LONG, 4)
            runtime.orchestrator.submit(job)
            while len(chunks) < 5:  # verify is part way through the prompt
                await asyncio.sleep(0.002)
            runtime.orchestrator.cancel(job)  # the client went away
            event = await asyncio.wait_for(job.events.get(), timeout=CALL_S)
            for _ in range(500):  # bounded: the Release and the Prefill's answer
                if "gone" not in v.engine.cache.seqs and not runtime.orchestrator.prefilling:
                    break
                await asyncio.sleep(0.01)
            return event, len(runtime.orchestrator.prefilling)

        event, prefilling = with_gateway(settings, go)
        assert event == Finished("abort")
        assert v.engine.cache.used_pages == 0 and "gone" not in v.engine.cache.seqs
        assert prefilling == 0
        assert len(chunks) < len(LONG)  # stopped part way: 400 chunks of one token


def test_a_prefill_slower_than_the_step_timeout_gets_time_by_its_length():
    """400 tokens at 2 per chunk, 5 ms a chunk: ~1 s, past verify_timeout_s (0.5 s). The
    Prefill's allowance (0.5 s + 400 / 100 tok/s) covers it: no worker lost, no retry."""
    with running(verify_server()) as v:
        before_each_forward(v, lambda: time.sleep(0.005))
        settings = GatewaySettings(verify_addr=v.endpoint, draft_addr="", verify_timeout_s=0.5,
                                   prefill_tokens_per_s=100.0)  # fmt: skip
        assert settings.prefill_timeout_s(400) == 4.5

        async def go(runtime):
            job = _job("long", LONG, 2)
            runtime.orchestrator.submit(job)
            ids = await _collect(job, [])
            return ids, job.attempts, [link.alive for link in runtime.verify.links.values()]

        ids, attempts, alive = with_gateway(settings, go)
    assert ids == target_only(LONG, 2)
    assert attempts == 1 and alive == [True]


def test_the_prefill_rate_must_be_positive():
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be > 0"):
        GatewaySettings(prefill_tokens_per_s=0)
