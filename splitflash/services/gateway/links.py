"""The gateway's links to its workers: one DEALER each, handshake, heartbeats, liveness."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import zmq.asyncio

from splitflash.protocol import (
    AsyncClient,
    Codec,
    Heartbeat,
    HeartbeatReply,
    HelloReply,
    ProtocolMismatch,
    async_handshake,
    connect,
    make_hello,
    make_socket,
)

log = logging.getLogger("splitflash.gateway.links")


class WorkerLink:
    """A worker service as the gateway sees it. `alive` flips with heartbeats; a worker that
    comes back is greeted again (a restarted worker has lost its per-request state, which
    `generation` lets the orchestrator notice)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        service: str,
        addr: str,
        requests: Codec,
        responses: Codec,
        heartbeat_s: float,
    ) -> None:
        self.service = service
        self.addr = addr
        self.heartbeat_s = heartbeat_s
        self.sock = make_socket(ctx, "dealer", identity=f"gw-{uuid.uuid4().hex[:8]}".encode())
        connect(self.sock, addr)
        self.client = AsyncClient(self.sock, requests, responses)
        self.alive = False
        self.hello: HelloReply | None = None
        self.generation = 0  # +1 at every successful handshake
        self.wants_target_layers: tuple[int, ...] = ()
        self.last_error = ""
        self.missed = 0
        self.on_up = None  # async callback(HelloReply) after every successful handshake
        self._task: asyncio.Task | None = None

    async def greet(self, timeout_s: float) -> bool:
        hello = make_hello("gateway", "gateway", self.wants_target_layers)
        try:
            self.hello = await async_handshake(self.client, hello, timeout_s=timeout_s)
        except ProtocolMismatch as exc:
            self.last_error = str(exc)
            log.error("%s at %s refused: %s", self.service, self.addr, exc)
            return False
        except Exception as exc:  # down or slow: the heartbeat loop retries
            self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        self.generation += 1
        if self.on_up is not None:
            await self.on_up(self.hello)
        if not self.alive:
            log.info("%s at %s is up (%s)", self.service, self.addr, dict(self.hello.info))
        self.alive = True
        self.last_error = ""
        return True

    async def beat(self) -> None:
        timeout = max(0.5, self.heartbeat_s)
        if not self.alive:
            await self.greet(timeout)
            return
        if self.client.in_flight:
            # A worker serves one message at a time: a heartbeat queued behind a long step
            # would time out on a healthy worker. The call in flight has its own deadline.
            return
        try:
            await self.client.call(
                Heartbeat(seq=self.generation, sent_at=time.time()),
                timeout_s=timeout,
                expect=HeartbeatReply,
            )
            self.missed = 0
        except Exception as exc:
            self.missed += 1
            if self.missed >= 2:
                self.mark_down(f"{self.missed} heartbeats missed: {exc}")

    def mark_down(self, why: str) -> None:
        if self.alive:
            log.warning("%s at %s is down: %s", self.service, self.addr, why)
        self.alive = False
        self.last_error = why

    def start(self) -> None:
        async def loop() -> None:
            while True:
                await self.beat()
                await asyncio.sleep(self.heartbeat_s)

        self._task = asyncio.create_task(loop(), name=f"heartbeat-{self.service}")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()
        self.sock.close(linger=0)
