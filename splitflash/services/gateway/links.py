"""The gateway's link to ONE worker process: a DEALER, handshake, heartbeats, liveness.

Liveness has two sources. Heartbeats catch a worker that hangs or a network that drops
packets; a socket monitor catches a worker whose connection closes (killed, restarted) at
once, and aborts the calls still waiting on it: a verify step in flight on a killed worker
fails in milliseconds instead of running into `verify_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

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
from splitflash.protocol.security import CurveClient

log = logging.getLogger("splitflash.gateway.links")

_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class WorkerLost(Exception):
    """The worker went away (disconnected, or marked down) while a call waited on it."""


class WorkerLink:
    """A worker process as the gateway sees it. `alive` flips with heartbeats and the socket
    monitor; a worker that comes back is greeted again (a restarted worker has lost its
    per-request state, which `generation` lets the orchestrator notice)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        service: str,
        addr: str,
        requests: Codec,
        responses: Codec,
        heartbeat_s: float,
        curve: CurveClient | None = None,
    ) -> None:
        self.service = service
        self.addr = addr
        self.heartbeat_s = heartbeat_s
        self.curve = curve
        self.sock = make_socket(
            ctx, "dealer", identity=f"gw-{uuid.uuid4().hex[:8]}".encode(), curve=curve
        )
        if addr.startswith("tcp://["):  # an IPv6 literal (from DNS discovery)
            self.sock.setsockopt(zmq.IPV6, 1)
        self._monitor = self.sock.get_monitor_socket(
            zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED, f"inproc://gw-mon-{uuid.uuid4().hex}"
        )
        connect(self.sock, addr)
        self.client = AsyncClient(self.sock, requests, responses)
        self.alive = False
        self.hello: HelloReply | None = None
        self.generation = 0  # +1 at every successful handshake
        self.wants_target_layers: tuple[int, ...] = ()
        self.last_error = "not connected yet"
        self.missed = 0
        self.on_up = None  # async callback(link, HelloReply) after every handshake
        self._down = asyncio.Event()  # set (and replaced) at every mark_down
        self._tasks: list[asyncio.Task] = []

    @property
    def takes_features(self) -> bool:
        """A drafter conditioned on target features (dflash): verify must feed it."""
        return bool(self.hello and self.hello.target_layer_ids)

    async def greet(self, timeout_s: float) -> bool:
        hello = make_hello("gateway", "gateway", self.wants_target_layers)
        try:
            self.hello = await async_handshake(self.client, hello, timeout_s=timeout_s)
        except ProtocolMismatch as exc:
            self.last_error = str(exc)
            log.error("%s at %s refused: %s", self.service, self.addr, exc)
            return False
        except Exception as exc:  # down or slow: the heartbeat loop retries
            if not self.last_error.startswith("CURVE"):  # keep the more telling reason
                self.last_error = f"{type(exc).__name__}: {exc}"
            return False
        self.generation += 1
        if self.on_up is not None:
            await self.on_up(self, self.hello)
        if not self.alive:
            log.info("%s at %s is up (%s)", self.service, self.addr, dict(self.hello.info))
        self.alive = True
        self.missed = 0
        self.last_error = ""
        return True

    async def call(self, msg, frames=(), *, timeout_s: float, expect: type | None = None):
        """`AsyncClient.call`, aborted with WorkerLost as soon as this worker goes down."""
        if not self.alive:
            raise WorkerLost(f"{self.service} at {self.addr} is down ({self.last_error})")
        down = self._down
        call = asyncio.ensure_future(
            self.client.call(msg, frames, timeout_s=timeout_s, expect=expect)
        )
        lost = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({call, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not call.done():  # lost, or this task was cancelled: abandon the call
                call.cancel()
                await asyncio.gather(call, return_exceptions=True)
        if call.cancelled():
            raise WorkerLost(f"{self.service} at {self.addr} went away: {self.last_error}")
        return call.result()

    async def beat(self) -> None:
        timeout = max(0.5, self.heartbeat_s)
        if not self.alive:
            await self.greet(timeout)
            return
        if self.client.in_flight:
            # A worker serves one message at a time (a long prompt's chunks between them): a
            # heartbeat queued behind a long step or chunk would time out on a healthy
            # worker. The call in flight has its own deadline.
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

    def mark_down(self, why: str, level: int = logging.WARNING) -> None:
        if self.alive:
            log.log(level, "%s at %s is down: %s", self.service, self.addr, why)
        self.alive = False
        self.last_error = why
        self._down.set()  # wakes the calls in flight; later calls wait on a fresh event
        self._down = asyncio.Event()

    async def _watch(self) -> None:
        """Socket events: a closed connection or a refused CURVE handshake."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] & _HANDSHAKE_FAILED:
                self.mark_down(
                    f"CURVE handshake with {self.addr} failed (event {event['event']}): "
                    "check the gateway's secret key and the worker's public key"
                )
            elif event["event"] == zmq.EVENT_DISCONNECTED and self.alive:
                self.mark_down("connection closed")

    def start(self) -> None:
        async def loop() -> None:
            while True:
                await self.beat()
                await asyncio.sleep(self.heartbeat_s)

        name = f"{self.service}@{self.addr}"
        self._tasks = [
            asyncio.create_task(loop(), name=f"heartbeat-{name}"),
            asyncio.create_task(self._watch(), name=f"monitor-{name}"),
        ]

    async def close(self) -> None:
        self.mark_down("closed by the gateway", logging.INFO)  # a shutdown, not a failure
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.aclose()
        with contextlib.suppress(zmq.ZMQError):  # already closed with its context
            self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
