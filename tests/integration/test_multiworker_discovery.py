"""Worker discovery and placement: a host name that resolves to several IPs (compose
`--scale verify=2`) becomes one link per IP, re-resolved (workers join and leave); new
requests go to the least-loaded alive worker; the recovery rule for a lost worker."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import zmq.asyncio

from splitflash.protocol import VERIFY_REQUESTS, VERIFY_RESPONSES
from splitflash.services.draft.config import DraftSettings
from splitflash.services.draft.server import DraftServer
from splitflash.services.gateway import discovery
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.discovery import WorkerPool, expand
from splitflash.services.gateway.jobs import Job
from splitflash.services.gateway.links import WorkerLink
from splitflash.services.gateway.placement import least_loaded, place
from splitflash.services.gateway.recovery import Recovery, recovery_for
from splitflash.services.verify.config import VerifySettings
from splitflash.services.verify.server import VerifyServer
from tests.conftest import tiny_engine, tiny_model
from tests.e2e.cluster import free_port
from tests.integration.test_workers_dataplane import FeatureRecordingDrafter
from tests.integration.workers_harness import Run, client_for, gateway_generate, running

ANY_PORT = "tcp://127.0.0.1:*"


def job(rid: str = "r", **kw) -> Job:
    base = dict(
        request_id=rid,
        prompt_ids=[1, 2],
        max_tokens=8,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=None,
        spec_enabled=True,
        block_size=4,
    )
    return Job(**{**base, **kw})


def test_expand_names_ips_and_other_transports():
    async def go():
        assert await expand("tcp://localhost:5555") == ["tcp://127.0.0.1:5555"]
        assert await expand("tcp://10.1.2.3:7") == ["tcp://10.1.2.3:7"]
        assert await expand("ipc:///tmp/x") == ["ipc:///tmp/x"]
        assert await expand("tcp://no-such-host.invalid:5555") == []

    asyncio.run(go())
    with pytest.raises(ValueError, match="HOST:PORT"):
        discovery.split_endpoint("tcp://verify")


def test_dns_name_with_several_ips_is_one_link_per_ip_and_follows_dns(monkeypatch):
    port = free_port()
    answers = {"ips": ["127.0.0.1", "127.0.0.2"]}
    real = socket.getaddrinfo

    def fake_getaddrinfo(host, *args, **kwargs):
        if host != "verify.test":
            return real(host, *args, **kwargs)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answers["ips"]]

    monkeypatch.setattr(socket, "getaddrinfo", fake_getaddrinfo)

    def server(ip: str) -> VerifyServer:
        settings = VerifySettings(bind=f"tcp://{ip}:{port}", metrics_port=0, draft_addr="")
        return VerifyServer(settings, engine=tiny_engine(tiny_model()), model_name="tiny")

    async def go():
        ctx = zmq.asyncio.Context()
        removed: list[str] = []

        async def on_removed(link):
            removed.append(link.addr)

        def make(endpoint):
            return WorkerLink(ctx, "verify", endpoint, VERIFY_REQUESTS, VERIFY_RESPONSES, 0.2)

        pool = WorkerPool("verify", (f"tcp://verify.test:{port}",), make, on_removed, 0.1)
        try:
            assert pool.dynamic
            await pool.refresh()
            assert sorted(pool.links) == [f"tcp://127.0.0.{i}:{port}" for i in (1, 2)]
            await pool.greet_all(5.0)
            assert len(pool.alive()) == 2  # two distinct processes behind one name
            answers["ips"] = ["127.0.0.2"]  # a replica left: its link goes
            await pool.refresh()
            assert list(pool.links) == [f"tcp://127.0.0.2:{port}"]
            assert removed == [f"tcp://127.0.0.1:{port}"]
            answers["ips"] = []  # DNS trouble, not every worker leaving: links are kept
            await pool.refresh()
            assert len(pool.links) == 1
            answers["ips"] = ["127.0.0.1", "127.0.0.2"]  # back (scale up again)
            pool.start()  # from now on links found are started (heartbeats greet them)
            await pool.refresh()
            link = pool.links[f"tcp://127.0.0.1:{port}"]
            async with asyncio.timeout(10):
                while not link.alive:
                    await asyncio.sleep(0.05)
        finally:
            await pool.close()
            ctx.term()

    with contextlib.ExitStack() as stack:
        for ip in ("127.0.0.1", "127.0.0.2"):
            stack.enter_context(running(server(ip)))
        asyncio.run(go())


class FakeLink:
    def __init__(self, addr: str) -> None:
        self.addr, self.alive = addr, True


def test_least_loaded_placement_counts_running_and_the_batch():
    a, b, c = FakeLink("a"), FakeLink("b"), FakeLink("c")
    running = [job("r1", verify=a), job("r2", verify=a), job("r3", verify=b)]
    batch = [job(f"n{i}") for i in range(4)]
    place(batch, [a, b, c], running, "verify")
    assert [j.verify.addr for j in batch] == ["c", "b", "c", "a"]
    assert least_loaded([], {}) is None
    lone = [job("x")]
    place(lone, [], running, "verify")
    assert lone[0].verify is None


def test_recovery_rule():
    s = GatewaySettings()
    assert recovery_for(job(), s)[0] is Recovery.RETRY
    streamed = job(generated=[5, 6], attempts=1)
    assert recovery_for(streamed, s)[0] is Recovery.RESUME  # greedy: exact continuation
    sampled = job(generated=[5], temperature=0.8, attempts=1)
    assert recovery_for(sampled, s)[0] is Recovery.RESUME  # unseeded sample: still a sample
    seeded = job(generated=[5], temperature=0.8, seed=3, attempts=1)
    assert recovery_for(seeded, s)[0] is Recovery.FAIL
    no_resume = GatewaySettings(resume_streamed=False)
    assert recovery_for(streamed, no_resume)[0] is Recovery.FAIL
    assert recovery_for(job(attempts=3), s)[0] is Recovery.FAIL  # max_attempts


def test_verify_sends_each_requests_features_to_the_draft_worker_it_names():
    """Two draft workers, no draft_addr on verify: PrefillItem.draft_peer (the endpoint the
    gateway pinned) picks where each request's features go."""
    drafters = [FeatureRecordingDrafter(), FeatureRecordingDrafter()]
    settings = VerifySettings(bind=ANY_PORT, metrics_port=0, draft_addr="")
    with contextlib.ExitStack() as stack:
        ds = [
            stack.enter_context(
                running(DraftServer(DraftSettings(bind=ANY_PORT, metrics_port=0), d))
            )
            for d in drafters
        ]
        v = stack.enter_context(running(VerifyServer(settings, engine=tiny_engine(tiny_model()))))
        for i, d in enumerate(ds):
            with client_for(v.endpoint, "verify") as vc, client_for(d.endpoint, "draft") as dc:
                run = Run(f"on-d{i}", [5, 6, 7, 8, 5, 6, 7, 8], max_tokens=6)
                gateway_generate(vc, dc, [run], block=4, draft_peer=d.endpoint)
    assert set(drafters[0].features) == {"on-d0"} and set(drafters[1].features) == {"on-d1"}
    assert sum(f.shape[0] for _, f in drafters[1].features["on-d1"]) >= 8  # prompt + steps
