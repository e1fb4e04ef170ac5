"""ZeroMQ CURVE on real sockets: a draft server with keys refuses peers without an allowed
key (no CURVE, a wrong client key, a wrong server key) and counts each refusal; it accepts
the gateway's and verify's keys. Keys come from `splitflash keys generate` files or inline.
"""

from __future__ import annotations

import time

import pytest
import zmq

from splitflash.cli.keys_cmd import ROLES, generate
from splitflash.protocol import (
    DRAFT_REQUESTS,
    DRAFT_RESPONSES,
    Client,
    PeerTimeout,
    handshake,
    make_hello,
    make_socket,
)
from splitflash.protocol.security import (
    CurveClient,
    client_curve_from,
    public_of,
    read_keys,
    read_one_key,
    server_keys,
    warn_if_exposed,
)
from splitflash.services.draft.config import DraftSettings
from splitflash.services.draft.server import DraftServer
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.verify.draft_link import DraftLink
from tests.integration.workers_harness import running


@pytest.fixture
def keys(tmp_path):
    env_file = generate(tmp_path)
    env = dict(ln.split("=", 1) for ln in env_file.read_text().splitlines() if "=" in ln)
    return tmp_path, env


def refused(server: DraftServer) -> float:
    sample = server.registry.get_sample_value(
        "splitflash_protocol_errors_total", {"service": "draft", "code": "unauthenticated"}
    )
    return sample or 0.0


def hello_from(endpoint: str, curve: CurveClient | None, timeout_s: float = 1.0):
    ctx = zmq.Context()
    sock = make_socket(ctx, "dealer", curve=curve)
    try:
        sock.connect(endpoint)
        client = Client(sock, DRAFT_REQUESTS, DRAFT_RESPONSES)
        return handshake(client, make_hello("gateway", "test"), timeout_s=timeout_s)
    finally:
        sock.close(linger=0)
        ctx.term()


def wait_counted(server: DraftServer, above: float) -> float:
    """The refusal counter once it passed `above` (the monitor thread counts, bounded)."""
    end = time.monotonic() + 5
    while refused(server) <= above and time.monotonic() < end:
        time.sleep(0.02)
    return refused(server)


def test_draft_server_refuses_and_counts_peers_without_an_allowed_key(keys):
    folder, env = keys
    settings = DraftSettings(
        bind="tcp://127.0.0.1:*",
        metrics_port=0,
        curve_secret_key_file=str(folder / "draft.key_secret"),
        curve_client_keys_file=str(folder),  # a directory: every *.key certificate in it
    )
    secret = {r: read_one_key("", str(folder / f"{r}.key_secret"), "secret", r) for r in ROLES}
    draft_pub = read_one_key("", str(folder / "draft.key"), "public", "draft")
    gateway = CurveClient(secret["gateway"], public_of(secret["gateway"]), draft_pub)
    with running(DraftServer(settings)) as server:
        end = server.endpoint
        assert hello_from(end, gateway).service == "draft"  # allowed: accepted
        assert refused(server) == 0

        with pytest.raises(PeerTimeout):  # plain TCP to a CURVE server
            hello_from(end, None)
        n = wait_counted(server, 0)
        assert n >= 1

        stranger_pub, stranger_sec = zmq.curve_keypair()
        with pytest.raises(PeerTimeout):  # CURVE, but a client key nobody allowed
            hello_from(end, CurveClient(stranger_sec, stranger_pub, draft_pub))
        n = wait_counted(server, n)

        with pytest.raises(PeerTimeout):  # the right client key, the wrong server key
            hello_from(end, CurveClient(secret["gateway"], public_of(secret["gateway"]), b"x" * 40))
        wait_counted(server, n)

        # verify's data plane to draft authenticates with verify's own keypair
        failures = []
        link = DraftLink(
            zmq.Context.instance(),
            end,
            peer_id="verify-test",
            timeout_s=1.0,
            hello_timeout_s=2.0,
            retry_s=5.0,
            chunk_rows=16,
            on_failure=failures.append,
            curve=CurveClient(secret["verify"], public_of(secret["verify"]), draft_pub),
        )
        try:
            assert link._connected() is not None and not failures
        finally:
            link.close()
        assert hello_from(end, gateway).service == "draft"  # still serving after refusals


def test_keys_from_env_values_and_clear_errors(keys):
    folder, env = keys
    settings = GatewaySettings(
        curve_secret_key=env["SPLITFLASH_GATEWAY_CURVE_SECRET_KEY"],
        verify_server_key=env["SPLITFLASH_GATEWAY_VERIFY_SERVER_KEY"],
        draft_server_key_file=str(folder / "draft.key"),
    )
    verify = client_curve_from(settings, "verify", "gateway")
    assert verify.server_key == read_keys("", str(folder / "verify.key"), "public", "v")[0]
    assert client_curve_from(GatewaySettings(), "verify", "gateway") is None  # plain TCP
    with pytest.raises(ValueError, match="both"):
        client_curve_from(
            GatewaySettings(verify_server_key=verify.server_key.decode()), "verify", "g"
        )
    with pytest.raises(ValueError, match="Z85"):
        read_keys("not-a-key", "", "public", "SPLITFLASH_DRAFT_CURVE_CLIENT_KEYS")
    with pytest.raises(ValueError, match="anyone"):
        server_keys(verify.secret_key, [], "draft")
    with pytest.raises(ValueError, match="does not exist"):
        read_keys("", str(folder / "missing.key"), "public", "x")
    assert (folder / "draft.key_secret").stat().st_mode & 0o077 == 0  # secrets are private
    assert warn_if_exposed("tcp://0.0.0.0:5555", None, "verify")
    assert not warn_if_exposed("tcp://127.0.0.1:5555", None, "verify")
    assert not warn_if_exposed("tcp://0.0.0.0:5555", verify, "verify")


def test_health_probe_uses_the_services_own_keypair_under_curve(keys, monkeypatch):
    from splitflash.cli.serve_cmd import probe

    folder, _env = keys
    settings = DraftSettings(
        bind="tcp://127.0.0.1:*",
        metrics_port=0,
        curve_secret_key_file=str(folder / "draft.key_secret"),
        curve_client_keys_file=str(folder / "gateway.key"),
    )
    with running(DraftServer(settings)) as server:
        monkeypatch.delenv("SPLITFLASH_DRAFT_CURVE_SECRET_KEY_FILE", raising=False)
        with pytest.raises(PeerTimeout):  # no keys: refused, like any stranger
            probe("draft", server.endpoint, 1.0)
        monkeypatch.setenv(
            "SPLITFLASH_DRAFT_CURVE_SECRET_KEY_FILE", str(folder / "draft.key_secret")
        )
        assert "ok" in probe("draft", server.endpoint, 2.0)
