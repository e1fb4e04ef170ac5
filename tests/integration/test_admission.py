"""Requests admitted together do not wait for each other's prefill.

Over real sockets (verify in a thread, the tiny random target, the gateway in-process): a
long prompt (200 slowed chunks) and a short one reach the gateway together, so they are
admitted in one batch. The short one streams its tokens while the long one is still
prefilling. When a batch was one Prefill, its items ran in order and shared one reply, so
the short request's first token came only after the long prompt's whole prefill.
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
    before_each_forward,
    target_only,
    verify_server,
    with_gateway,
)
from tests.integration.workers_harness import running

pytestmark = pytest.mark.timeout(120)


def test_a_short_prompt_admitted_with_a_long_one_streams_before_the_long_one_starts():
    with running(verify_server()) as v:
        before_each_forward(v, lambda: time.sleep(0.005))  # 200 chunks: ~1 s of prefill
        settings = GatewaySettings(verify_addr=v.endpoint, draft_addr="")

        async def go(runtime):
            arrivals: list[tuple[float, str, int]] = []
            long, short = _job("long", LONG, 4), _job("short", SHORT, 20)
            runtime.orchestrator.submit(long)  # no await between: one admission batch
            runtime.orchestrator.submit(short)
            outs = await asyncio.gather(_collect(long, arrivals), _collect(short, arrivals))
            return outs, arrivals

        (long_ids, short_ids), arrivals = with_gateway(settings, go)
    first = {rid: min(t for t, r, _ in arrivals if r == rid) for rid in ("long", "short")}
    short_done = max(t for t, r, _ in arrivals if r == "short")
    assert short_done < first["long"], (first, short_done)  # all 20 before the long's first
    assert short_ids == target_only(SHORT, 20) and long_ids == target_only(LONG, 4)
