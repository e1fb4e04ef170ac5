"""`splitflash serve gateway|draft|verify` (one service, what compose runs) and
`splitflash health draft|verify --addr ADDR` (Hello + Heartbeat; exit 0 healthy, 1 not).

Flags override the SPLITFLASH_<SERVICE>_* environment variables; unset flags leave them.
"""

from __future__ import annotations

import argparse
import time

import zmq

_SERVICE_FLAGS = {
    # flag -> (settings field, type, help); None = every service has it
    "--bind": ("bind", str, "ZeroMQ endpoint to bind (ROUTER)"),
    "--metrics-port": ("metrics_port", int, "prometheus port (0 = off)"),
    "--metrics-host": ("metrics_host", str, "prometheus bind address"),
    "--device": ("device", str, "cpu | cuda | cuda:N"),
    "--target": ("target", str, "target model name or path"),
}
_VERIFY_FLAGS = {
    "--dtype": ("dtype", str, "float32 | float16 | bfloat16 (default by device)"),
    "--kv-pages": ("kv_pages", int, "KV pool size in pages"),
    "--page-size": ("page_size", int, "tokens per KV page"),
    "--max-batch": ("max_batch", int, "most items per batched call"),
    "--draft-addr": ("draft_addr", str, "draft service endpoint for features ('' = none)"),
}
_DRAFT_FLAGS = {
    "--drafter": ("drafter", str, "ngram | dflash | dflash:PATH | none"),
    "--window-override": ("window_override", str, "checkpoint | off (experiment)"),
    "--max-batch": ("max_batch", int, "most items per Propose"),
}


def register(sub) -> None:
    serve = sub.add_parser("serve", help="run one service until SIGTERM/Ctrl-C")
    services = serve.add_subparsers(dest="service", required=True)
    gateway = services.add_parser("gateway", help="HTTP gateway (OpenAI API)")
    gateway.add_argument("--port", type=int, default=None, help="HTTP port")
    gateway.add_argument("--host", default=None, help="HTTP bind address")
    gateway.set_defaults(run=_run_gateway, flags={"--port": ("port",), "--host": ("host",)})
    for name, extra, runner in (
        ("verify", _VERIFY_FLAGS, _run_verify),
        ("draft", _DRAFT_FLAGS, _run_draft),
    ):
        p = services.add_parser(name, help=f"{name} service (ZeroMQ ROUTER)")
        flags = {**_SERVICE_FLAGS, **extra}
        for flag, (_field, kind, text) in flags.items():
            p.add_argument(flag, type=kind, default=None, help=text)
        p.set_defaults(run=runner, flags=flags)

    health = sub.add_parser("health", help="probe a service: Hello + Heartbeat, exit 0/1")
    health.add_argument("service", choices=["draft", "verify"])
    health.add_argument(
        "--addr", default=None, help="default: the service's own bind address from its settings"
    )
    health.add_argument("--timeout", type=float, default=3.0, help="seconds per call")
    health.set_defaults(run=_run_health)


def _overrides(args: argparse.Namespace) -> dict:
    """Settings fields given on the command line (None = not given, env/defaults apply)."""
    out = {}
    for flag, (field, *_rest) in args.flags.items():
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            out[field] = value
    return out


def _run_gateway(args: argparse.Namespace) -> int:
    from splitflash.services.gateway.server import run

    return int(run(_overrides(args)) or 0)


def _run_verify(args: argparse.Namespace) -> int:
    from splitflash.services.verify.__main__ import run

    return run(**_overrides(args))


def _run_draft(args: argparse.Namespace) -> int:
    from splitflash.services.draft.__main__ import run

    return run(**_overrides(args))


def probe(service: str, addr: str, timeout_s: float) -> str:
    """One line describing a healthy service; raises (PeerTimeout, ProtocolError) if not."""
    from splitflash.protocol import (
        DRAFT_REQUESTS,
        DRAFT_RESPONSES,
        VERIFY_REQUESTS,
        VERIFY_RESPONSES,
        Client,
        Heartbeat,
        HeartbeatReply,
        ProtocolError,
        handshake,
        make_hello,
        make_socket,
    )

    codecs = {
        "draft": (DRAFT_REQUESTS, DRAFT_RESPONSES),
        "verify": (VERIFY_REQUESTS, VERIFY_RESPONSES),
    }[service]
    ctx = zmq.Context()
    sock = make_socket(ctx, "dealer", curve=_own_curve(service))
    try:
        sock.connect(addr)
        client = Client(sock, *codecs)
        hello = handshake(client, make_hello("health", "health"), timeout_s=timeout_s)
        if hello.service != service:
            raise ProtocolError(f"{addr} is a {hello.service!r} service, not {service!r}")
        t0 = time.time()
        client.call(Heartbeat(seq=0, sent_at=t0), timeout_s=timeout_s, expect=HeartbeatReply)
        rtt_ms = (time.time() - t0) * 1000
        return f"{service} at {addr}: ok, model {hello.model}, heartbeat {rtt_ms:.1f} ms"
    finally:
        sock.close(linger=0)
        ctx.term()


def _own_curve(service: str):
    """Under CURVE a probe speaks with the service's own keypair, which the service admits
    (a healthcheck runs beside the service, with its settings); None = plain TCP."""
    from splitflash.protocol.security import CurveClient, public_of, read_one_key
    from splitflash.services.common.settings import load_settings

    if service == "verify":
        from splitflash.services.verify.config import VerifySettings as cls
    else:
        from splitflash.services.draft.config import DraftSettings as cls
    settings = load_settings(cls, f"SPLITFLASH_{service.upper()}_")
    secret = read_one_key(
        settings.curve_secret_key, settings.curve_secret_key_file, "secret", f"{service} secret key"
    )
    if secret is None:
        return None
    public = public_of(secret)
    return CurveClient(secret_key=secret, public_key=public, server_key=public)


def _own_addr(service: str) -> str:
    """The service's bind address (settings/env), as a client on this host reaches it."""
    from splitflash.services.common.settings import load_settings

    if service == "verify":
        from splitflash.services.verify.config import VerifySettings as cls
    else:
        from splitflash.services.draft.config import DraftSettings as cls
    bind = load_settings(cls, f"SPLITFLASH_{service.upper()}_").bind
    return bind.replace("0.0.0.0", "127.0.0.1").replace("://*:", "://127.0.0.1:")


def _run_health(args: argparse.Namespace) -> int:
    args.addr = args.addr or _own_addr(args.service)
    from splitflash.protocol import PeerTimeout, ProtocolError

    try:
        print(probe(args.service, args.addr, args.timeout))
    except (PeerTimeout, ProtocolError) as e:
        print(f"{args.service} at {args.addr}: UNHEALTHY: {e}")
        return 1
    return 0
