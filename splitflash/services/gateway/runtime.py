"""Everything the gateway holds while it runs: settings, tokenizer, links, metrics, loop."""

from __future__ import annotations

import logging

import zmq.asyncio
from prometheus_client import CollectorRegistry

from splitflash.protocol import DRAFT_REQUESTS, DRAFT_RESPONSES, VERIFY_REQUESTS, VERIFY_RESPONSES
from splitflash.services.common.metrics import gateway_metrics
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.links import WorkerLink
from splitflash.services.gateway.orchestrator import Orchestrator

log = logging.getLogger("splitflash.gateway")


class GatewayRuntime:
    def __init__(self, settings: GatewaySettings, tokenizer) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.registry = CollectorRegistry()
        self.metrics = gateway_metrics(self.registry)
        self.ctx: zmq.asyncio.Context | None = None
        self.orchestrator: Orchestrator | None = None

    async def start(self) -> None:
        s = self.settings
        self.ctx = zmq.asyncio.Context()
        verify = WorkerLink(
            self.ctx, "verify", s.verify_addr, VERIFY_REQUESTS, VERIFY_RESPONSES, s.heartbeat_s
        )
        draft = None
        if s.draft_addr:
            draft = WorkerLink(
                self.ctx, "draft", s.draft_addr, DRAFT_REQUESTS, DRAFT_RESPONSES, s.heartbeat_s
            )

            async def drafter_up(hello) -> None:
                # verify must capture the target layers this drafter conditions on; a new
                # drafter may want other layers, so verify is greeted again
                layers = tuple(hello.target_layer_ids)
                if layers != verify.wants_target_layers:
                    verify.wants_target_layers = layers
                    if verify.alive:
                        await verify.greet(timeout_s=2.0)

            draft.on_up = drafter_up
            await draft.greet(timeout_s=2.0)
        await verify.greet(timeout_s=2.0)
        self.orchestrator = Orchestrator(s, verify, draft, self.metrics)
        verify.start()
        if draft is not None:
            draft.start()
        self.orchestrator.start()
        log.info(
            "gateway on http://%s:%d (verify %s, draft %s)",
            s.host,
            s.port,
            s.verify_addr,
            s.draft_addr or "none",
        )

    async def stop(self) -> None:
        if self.orchestrator is not None:
            await self.orchestrator.stop()
            for link in (self.orchestrator.verify, self.orchestrator.draft):
                if link is not None:
                    await link.close()
        if self.ctx is not None:
            self.ctx.term()

    def status(self) -> dict:
        orch = self.orchestrator
        verify_ok = bool(orch and orch.verify.alive)
        draft = orch.draft if orch else None
        return {
            "ready": verify_ok,
            "model": self.settings.model_name,
            "verify": {
                "addr": self.settings.verify_addr,
                "alive": verify_ok,
                "error": orch.verify.last_error if orch else "starting",
            },
            "draft": None
            if draft is None
            else {
                "addr": draft.addr,
                "alive": draft.alive,
                "error": draft.last_error,
                "info": dict(draft.hello.info) if draft.hello else {},
            },
            "running": len(orch.running) if orch else 0,
            "waiting": len(orch.waiting) if orch else 0,
        }
