"""A step held up behind another request's prefill chunk is counted as queueing.

Over real sockets (verify in a thread, the tiny random target, the gateway in-process):
while a long prompt prefills in slowed chunks, a running stream's steps wait behind them.
The verify service reports that wait ("queued" in its replies, serve_forever's QueueClock)
and the gateway counts it as the step's `queue` phase: before, it was all `transport`, so
a dashboard blamed the network for a long prompt's admission.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from splitflash.services.gateway.config import GatewaySettings
from tests.integration.test_prefill_interleaving import (
    LONG,
    SHORT,
    _collect,
    _job,
    target_only,
    verify_server,
    with_gateway,
)
from tests.integration.workers_harness import running

pytestmark = pytest.mark.timeout(120)
CHUNK_S = 0.03  # each prompt chunk's forward, slowed; decode steps are not


def test_a_step_held_up_by_a_prefill_chunk_counts_it_as_queue_not_transport():
    with running(verify_server(chunk=8)) as v:
        forward = v.engine.model.forward

        def slow_chunks(batch, *args, **kwargs):  # batch.token_ids [N]: 8 in a chunk
            if len(batch.token_ids) == 8:
                time.sleep(CHUNK_S)
            return forward(batch, *args, **kwargs)

        v.engine.model.forward = slow_chunks
        settings = GatewaySettings(verify_addr=v.endpoint, draft_addr="")

        async def go(runtime):
            stream = _job("stream", SHORT, 40)
            runtime.orchestrator.submit(stream)
            streaming = asyncio.create_task(_collect(stream, arrivals := []))
            while not arrivals:  # the stream has started
                await asyncio.sleep(0.005)
            late = _job("late", LONG, 2)  # 50 chunks of 8
            runtime.orchestrator.submit(late)
            ids = await asyncio.gather(streaming, _collect(late, []))
            sample = runtime.registry.get_sample_value
            queue_s = sample("splitflash_step_phase_seconds_sum", {"phase": "queue"})
            return ids, list(stream.trace), queue_s

        (stream_ids, late_ids), trace, queue_s = with_gateway(settings, go)
    assert stream_ids == target_only(SHORT, 40) and late_ids == target_only(LONG, 2)
    held = [s for s in trace if s["queue_ms"] > 0.5 * CHUNK_S * 1e3]  # waited behind a chunk
    assert len(held) >= 5, [s["queue_ms"] for s in trace]
    queue_ms = sum(s["queue_ms"] for s in held)
    # within each held step, what is left to transport is the sockets' part: small
    assert sum(s["transport_ms"] for s in held) < 0.2 * queue_ms
    # the metric the dashboards stack: queue at least what the traces saw
    assert queue_s >= queue_ms / 1e3 - 1e-6
