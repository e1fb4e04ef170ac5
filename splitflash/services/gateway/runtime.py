"""Everything the gateway holds while it runs: settings, tokenizer, worker pools, metrics,
the orchestrator loop."""

from __future__ import annotations

import logging

import zmq.asyncio
from prometheus_client import CollectorRegistry

from splitflash.protocol import DRAFT_REQUESTS, DRAFT_RESPONSES, VERIFY_REQUESTS, VERIFY_RESPONSES
from splitflash.protocol.security import client_curve_from, warn_if_exposed
from splitflash.services.common.metrics import gateway_metrics
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.discovery import WorkerPool
from splitflash.services.gateway.drafting import Drafting
from splitflash.services.gateway.links import WorkerLink
from splitflash.services.gateway.orchestrator import Orchestrator

log = logging.getLogger("splitflash.gateway")
GREET_S = 2.0


class GatewayRuntime:
    def __init__(self, settings: GatewaySettings, tokenizer) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.registry = CollectorRegistry()
        self.metrics = gateway_metrics(self.registry)
        # keys are read here, so a bad key fails at start-up with the variable's name
        self.curves = {
            service: client_curve_from(settings, service, "gateway")
            for service in ("verify", "draft")
        }
        self.ctx: zmq.asyncio.Context | None = None
        self.orchestrator: Orchestrator | None = None
        self.verify: WorkerPool | None = None
        self.draft: WorkerPool | None = None
        self.layers: tuple[int, ...] = ()  # target layers the drafters condition on

    def _link(self, service: str, endpoint: str) -> WorkerLink:
        codecs = {
            "verify": (VERIFY_REQUESTS, VERIFY_RESPONSES),
            "draft": (DRAFT_REQUESTS, DRAFT_RESPONSES),
        }[service]
        curve = self.curves[service]
        warn_if_exposed(endpoint, curve, f"gateway link to {service}")
        link = WorkerLink(self.ctx, service, endpoint, *codecs, self.settings.heartbeat_s, curve)
        if service == "verify":
            link.wants_target_layers = self.layers
            link.on_up = self._verify_up
        else:
            link.on_up = self._drafter_up
        return link

    def _maker(self, service: str):
        return lambda endpoint: self._link(service, endpoint)

    async def _drafter_up(self, link: WorkerLink, hello) -> None:
        # verify must capture the target layers the drafters condition on; a new drafter
        # may want other layers, so every verify worker is greeted again
        layers = tuple(hello.target_layer_ids)
        if layers == self.layers:
            return
        others = [d for d in self.draft.links.values() if d is not link and d.alive]
        if any(tuple(d.hello.target_layer_ids) != layers for d in others if d.hello):
            log.error(
                "draft workers disagree on target layers (%s wants %s): run one drafter "
                "kind per deployment",
                link.addr,
                list(layers),
            )
        self.layers = layers
        for verify in self.verify.links.values():
            verify.wants_target_layers = layers
            if verify.alive:
                await verify.greet(timeout_s=GREET_S)

    async def _verify_up(self, link: WorkerLink, hello) -> None:
        if (warning := graph_batch_warning(self.settings.max_running, hello.info)) is not None:
            log.warning("verify at %s: %s", link.addr, warning)

    async def _removed(self, link: WorkerLink) -> None:
        if self.orchestrator is not None:
            await self.orchestrator.forget_worker(link)

    async def start(self) -> None:
        s = self.settings
        self.ctx = zmq.asyncio.Context()
        self.verify, self.draft = (
            WorkerPool(name, addrs, self._maker(name), self._removed, s.discovery_s)
            for name, addrs in (("verify", s.verify_endpoints), ("draft", s.draft_endpoints))
        )
        await self.draft.refresh()
        await self.verify.refresh()
        # drafters first: their HelloReply says which target layers verify must capture
        await self.draft.greet_all(GREET_S)
        await self.verify.greet_all(GREET_S)
        drafting = Drafting(s, self.draft if s.draft_endpoints else None)
        self.orchestrator = Orchestrator(s, self.verify, drafting, self.metrics)
        self.verify.start()
        self.draft.start()
        self.orchestrator.start()
        log.info(
            "gateway on http://%s:%d (verify %s -> %d worker(s), draft %s -> %d worker(s))",
            s.host,
            s.port,
            ",".join(s.verify_endpoints),
            len(self.verify.links),
            ",".join(s.draft_endpoints) or "none",
            len(self.draft.links),
        )

    async def stop(self) -> None:
        if self.orchestrator is not None:
            await self.orchestrator.stop()
        for pool in (self.verify, self.draft):
            if pool is not None:
                await pool.close()
        if self.ctx is not None:
            self.ctx.term()

    def _service_status(self, pool: WorkerPool | None, role: str) -> dict | None:
        if pool is None or not pool.addrs:
            return None
        running = self.orchestrator.admitted if self.orchestrator else []
        workers = [
            {
                "addr": link.addr,
                "alive": link.alive,
                "error": link.last_error,
                "running": sum(1 for j in running if getattr(j, role) is link),
                "info": dict(link.hello.info) if link.hello else {},
            }
            for link in pool.links.values()
        ]
        errors = sorted({w["error"] for w in workers if w["error"]})
        return {
            "addr": ",".join(pool.addrs),
            "alive": any(w["alive"] for w in workers),
            "error": "; ".join(errors) if workers else "no worker found (DNS)",
            "info": next((w["info"] for w in workers if w["alive"]), {}),
            "workers": workers,
        }

    def status(self) -> dict:
        orch = self.orchestrator
        verify = self._service_status(self.verify, "verify")
        return {
            "ready": bool(verify and verify["alive"]),
            "model": self.settings.model_name,
            "verify": verify,
            "draft": self._service_status(self.draft, "draft"),
            "running": len(orch.running) if orch else 0,
            "prefilling": len(orch.prefilling) if orch else 0,
            "waiting": len(orch.waiting) if orch else 0,
        }


def graph_batch_warning(max_running: int, verify_info) -> str | None:
    """A step batches up to max_running requests; verify replays CUDA graphs only up to its
    largest graph batch (Hello info "graph_max_batch", 0 = no graphs) and runs bigger steps
    eagerly, several times slower for a small model. Said at the handshake, where the two
    settings meet, rather than found later in splitflash_verify_forwards_total."""
    largest = int(verify_info.get("graph_max_batch") or 0)
    if not 0 < largest < max_running:
        return None
    return (
        f"the gateway's max_running {max_running} exceeds verify's largest CUDA graph batch "
        f"{largest}: steps of more than {largest} requests run eagerly (raise "
        f"SPLITFLASH_VERIFY_GRAPH_MAX_BATCH or lower SPLITFLASH_GATEWAY_MAX_RUNNING)"
    )
