"""Which worker processes exist: configured addresses, expanded through DNS.

`tcp://10.0.0.5:5555` is one worker. `tcp://verify:5555` is every address `verify`
resolves to: docker compose gives each replica of a scaled service (`--scale verify=2`)
its own IP under the service's name. The pool re-resolves every `discovery_s`: a new IP gets
a link (heartbeats start, it joins placement once greeted); an IP that vanished from DNS
loses its link, and the orchestrator treats its requests like a worker that died.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from urllib.parse import urlsplit

from splitflash.services.gateway.links import WorkerLink

log = logging.getLogger("splitflash.gateway.discovery")


def split_endpoint(addr: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of a tcp endpoint, None for other transports (ipc, inproc)."""
    if not addr.startswith("tcp://"):
        return None
    parts = urlsplit(addr)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"worker address {addr!r}: expected tcp://HOST:PORT")
    return "tcp", parts.hostname, parts.port


def is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def expand(addr: str) -> list[str]:
    """The endpoints `addr` stands for now: itself for an IP or a non-tcp endpoint, one
    `tcp://IP:PORT` per IPv4 address of a host name (IPv6 only when it has no IPv4: one
    process listening on both must not count as two workers). [] if it does not resolve."""
    parts = split_endpoint(addr)
    if parts is None or is_literal(parts[1]):
        return [addr]
    _, host, port = parts
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        log.info("%s does not resolve (yet): %s", host, exc)
        return []
    v4 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET})
    v6 = sorted({i[4][0] for i in infos if i[0] == socket.AF_INET6})
    if v4:
        return [f"tcp://{ip}:{port}" for ip in v4]
    return [f"tcp://[{ip}]:{port}" for ip in v6]


class WorkerPool:
    """The links of one service (verify or draft), keyed by endpoint."""

    def __init__(
        self,
        service: str,
        addrs: tuple[str, ...],
        make_link: Callable[[str], WorkerLink],
        on_removed: Callable[[WorkerLink], Awaitable[None]],
        refresh_s: float,
    ) -> None:
        for addr in addrs:
            split_endpoint(addr)  # a malformed address is a start-up error, not a silent skip
        self.service = service
        self.addrs = addrs
        self.links: dict[str, WorkerLink] = {}
        self._make_link = make_link
        self._on_removed = on_removed
        self._refresh_s = refresh_s
        self._task: asyncio.Task | None = None
        self._started = False

    @property
    def dynamic(self) -> bool:
        """Some address is a host name, so the set of workers may change."""
        return any(
            (p := split_endpoint(a)) is not None and not is_literal(p[1]) for a in self.addrs
        )

    def alive(self) -> list[WorkerLink]:
        return [link for link in self.links.values() if link.alive]

    async def refresh(self) -> None:
        found: list[str] = []
        for endpoints in await asyncio.gather(*(expand(a) for a in self.addrs)):
            found += [e for e in endpoints if e not in found]
        if not found and self.links:
            # Resolution failing outright is more likely DNS trouble than every worker
            # leaving at once: keep the links, heartbeats still tell who is alive.
            return
        for endpoint in found:
            if endpoint not in self.links:
                link = self._make_link(endpoint)
                self.links[endpoint] = link
                log.info("%s worker found at %s", self.service, endpoint)
                if self._started:
                    link.start()
        for endpoint in [e for e in self.links if e not in found]:
            link = self.links.pop(endpoint)
            log.warning("%s worker at %s left DNS: dropping it", self.service, endpoint)
            link.mark_down("no longer in DNS")
            await self._on_removed(link)
            await link.close()

    async def greet_all(self, timeout_s: float) -> None:
        await asyncio.gather(*(link.greet(timeout_s) for link in self.links.values()))

    def start(self) -> None:
        self._started = True
        for link in self.links.values():
            link.start()
        if self.dynamic:
            self._task = asyncio.create_task(self._loop(), name=f"discovery-{self.service}")

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._refresh_s)
            try:
                await self.refresh()
            except Exception:  # a discovery bug must not stop serving the workers we have
                log.exception("%s discovery failed", self.service)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for link in self.links.values():
            await link.close()
        self.links.clear()
