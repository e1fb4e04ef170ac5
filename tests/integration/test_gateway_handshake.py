"""What the gateway checks when it greets a verify worker (GatewayRuntime over a real verify
server on loopback): a gateway that batches more requests than verify's largest CUDA graph
says so, naming both settings, since those steps would run eagerly."""

from __future__ import annotations

import asyncio
import logging

import pytest

from splitflash.models.graphs import VerifyGraphs
from splitflash.models.kv_cache import PagedKVCache
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.runtime import GatewayRuntime
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.engine import TargetEngine
from splitflash.services.verify.server import VerifyServer
from tests.conftest import tiny_model
from tests.integration.workers_harness import running


@pytest.mark.parametrize(("max_running", "warned"), [(16, True), (2, False)])
def test_batching_past_the_largest_graph_is_warned_at_the_handshake(caplog, max_running, warned):
    model = tiny_model()
    cfg = model.cfg
    cache = PagedKVCache(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, scratch_pages=16)
    engine = TargetEngine(model, cache, graphs=VerifyGraphs(model, cache, (1, 2), capture=False))
    settings = VerifySettings(bind="tcp://127.0.0.1:*", metrics_port=0, draft_addr="")
    with running(VerifyServer(settings, engine=engine)) as v:
        gateway = GatewaySettings(verify_addr=v.endpoint, draft_addr="", max_running=max_running)

        async def greet():
            runtime = GatewayRuntime(gateway, tokenizer=None)
            await runtime.start()
            await runtime.stop()

        with caplog.at_level(logging.WARNING):
            asyncio.run(greet())
    said = [r.getMessage() for r in caplog.records if "largest CUDA graph" in r.getMessage()]
    assert len(said) == int(warned), said
    if warned:
        assert f"max_running {max_running} exceeds verify's largest CUDA graph batch 2" in said[0]
