"""ZeroMQ CURVE: key loading, socket options, and the server-side guard (ZAP + refusal count).

Roles: every service owns one keypair (the secret key; the public key is derived from it).
A service that binds (verify, draft) is a CURVE *server*: it allows only the client public
keys it was given. A service that connects (the gateway; verify towards draft) is a CURVE
*client*: it needs the server's public key. Keys are Z85 text (40 characters), given
inline (env var) or in a file: a bare key, or a ZeroMQ certificate (`public-key = "..."`,
`secret-key = "..."`, as `splitflash keys generate` writes). A file of allowed client keys
may list several; a directory means every `*.key` certificate in it.

No keys configured: plain TCP, as before (one warning if the endpoint is not loopback).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth.thread
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

ZAP_DOMAIN = "splitflash"
REFUSED_CODE = "unauthenticated"  # protocol_errors_total{code=...} of refused handshakes
_Z85 = re.compile(r"^[0-9a-zA-Z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")
_CERT_LINE = re.compile(r'^\s*(public|secret)-key\s*=\s*"(.{40})"\s*$')
# Server-side events of a handshake that did not authenticate: no CURVE or the wrong
# server key (protocol), a client key ZAP refused (auth), or libzmq gave no reason.
_REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass(frozen=True)
class CurveServer:
    """A binding socket's keys and the client public keys it lets in."""

    secret_key: bytes
    public_key: bytes
    allowed_clients: frozenset[bytes]


@dataclass(frozen=True)
class CurveClient:
    """A connecting socket's own keys and the public key of the server it trusts."""

    secret_key: bytes
    public_key: bytes
    server_key: bytes


def _check_key(key: str, what: str) -> bytes:
    key = key.strip()
    if not _Z85.match(key):
        raise ValueError(f"{what}: not a 40-character Z85 CURVE key")
    return key.encode()


def _keys_in_text(text: str, kind: str, what: str) -> list[bytes]:
    """Keys of `kind` ("public"|"secret") of a certificate, else every bare key line."""
    lines = text.splitlines()
    cert = [m for m in map(_CERT_LINE.match, lines) if m]
    if cert:
        return [_check_key(m.group(2), what) for m in cert if m.group(1) == kind]
    # "#" is a Z85 character: only whole lines starting with it are comments
    bare = (ln.strip() for ln in lines)
    return [_check_key(ln, what) for ln in bare if ln and not ln.startswith("#")]


def read_keys(inline: str, path: str, kind: str, what: str) -> list[bytes]:
    """Keys from an inline comma-separated value and/or a file or directory of files."""
    keys = [_check_key(k, what) for k in inline.split(",") if k.strip()]
    if path:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"{what}: {path} does not exist")
        files = sorted(p.glob("*.key")) if p.is_dir() else [p]
        for f in files:
            keys += _keys_in_text(f.read_text(), kind, f"{what} ({f})")
    return keys


def read_one_key(inline: str, path: str, kind: str, what: str) -> bytes | None:
    keys = read_keys(inline, path, kind, what)
    if len(keys) > 1:
        raise ValueError(f"{what}: expected one {kind} key, found {len(keys)}")
    return keys[0] if keys else None


def public_of(secret_key: bytes) -> bytes:
    return zmq.curve_public(secret_key)


def server_keys(secret: bytes | None, allowed: list[bytes], what: str) -> CurveServer | None:
    """CURVE server settings, or None (plain TCP) when no secret key is configured."""
    if secret is None:
        if allowed:
            raise ValueError(f"{what}: allowed client keys given but no secret key")
        return None
    if not allowed:
        raise ValueError(
            f"{what}: a CURVE secret key without allowed client keys would let anyone in; "
            "set the client keys (…_CURVE_CLIENT_KEYS or …_CURVE_CLIENT_KEYS_FILE)"
        )
    public = public_of(secret)
    # The service's own key is allowed too, so a health probe run with the service's own
    # keypair (inside its container) authenticates.
    return CurveServer(secret, public, frozenset(allowed) | {public})


def client_keys(secret: bytes | None, server: bytes | None, what: str) -> CurveClient | None:
    """CURVE client settings, or None when neither key is configured (plain TCP)."""
    if secret is None and server is None:
        return None
    if secret is None or server is None:
        raise ValueError(f"{what}: CURVE needs both this side's secret key and the server key")
    return CurveClient(secret, public_of(secret), server)


def apply_curve(sock: zmq.Socket, curve: CurveServer | CurveClient) -> None:
    """Set the CURVE options (before bind/connect, or they do not apply)."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, curve.secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, curve.public_key)
    if isinstance(curve, CurveServer):
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    else:
        sock.setsockopt(zmq.CURVE_SERVERKEY, curve.server_key)


def warn_if_exposed(endpoint: str, curve: object | None, what: str) -> bool:
    """Log (once per call site) that a non-loopback endpoint runs without CURVE."""
    host = endpoint.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    loopback = host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")
    if curve is None and endpoint.startswith("tcp://") and not loopback:
        log.warning(
            "%s on %s without CURVE: anyone who can reach it can drive it "
            "(set the CURVE keys, see `splitflash keys generate`)",
            what,
            endpoint,
        )
        return True
    return False


class _AllowList:
    """ZAP credentials provider: the handshake passes only for an allowed client key."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


class CurveGuard:
    """Server side: a ZAP authenticator on the context (allow-list of client keys) and a
    monitor thread counting every refused handshake through `on_refused(REFUSED_CODE)`.

    Start it before the socket binds: libzmq asks ZAP on every handshake, and a socket
    whose ZAP handler is missing would let clients in unchecked.
    """

    def __init__(self, ctx: zmq.Context, curve: CurveServer, on_refused: Callable[[str], None]):
        self._auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=log.getChild("zap"))
        self._auth.start()
        self._auth.configure_curve_callback(
            domain=ZAP_DOMAIN, credentials_provider=_AllowList(curve.allowed_clients)
        )
        self._on_refused = on_refused
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mon: zmq.Socket | None = None

    def watch(self, sock: zmq.Socket) -> None:
        """Count the refused handshakes of `sock` (call once, from the thread owning it)."""
        self._mon = sock.get_monitor_socket(_REFUSED_EVENTS, f"inproc://zap-{uuid.uuid4().hex}")
        self._thread = threading.Thread(target=self._count, name="curve-monitor", daemon=True)
        self._thread.start()

    def _count(self) -> None:
        mon = self._mon
        while not self._stop.is_set():
            try:
                if not mon.poll(200):  # bounded wait so stop() is seen
                    continue
                event = parse_monitor_message(mon.recv_multipart())
            except zmq.ZMQError:
                return
            if event["event"] & _REFUSED_EVENTS:
                log.warning(
                    "refused an unauthenticated peer (%s) on %s",
                    _EVENT_NAMES.get(event["event"], event["event"]),
                    event["endpoint"].decode(errors="replace"),
                )
                self._on_refused(REFUSED_CODE)

    def stop(self, sock: zmq.Socket | None = None) -> None:
        """Stop counting and the authenticator; call before the context terminates."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if sock is not None and not sock.closed:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
        if self._mon is not None:
            self._mon.close(linger=0)
        self._auth.stop()


_EVENT_NAMES = {
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "no CURVE or wrong server key",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "client key not allowed",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed",
}


# ------------------------------------------------------------------ from service settings


def server_curve_from(settings, what: str) -> CurveServer | None:
    """From a settings object's `curve_secret_key[_file]`, `curve_client_keys[_file]`."""
    secret = read_one_key(
        settings.curve_secret_key, settings.curve_secret_key_file, "secret", f"{what} secret key"
    )
    allowed = read_keys(
        settings.curve_client_keys,
        settings.curve_client_keys_file,
        "public",
        f"{what} allowed client keys",
    )
    return server_keys(secret, allowed, what)


def client_curve_from(settings, server: str, what: str) -> CurveClient | None:
    """From `curve_secret_key[_file]` and `<server>_server_key[_file]` of a settings object."""
    secret = read_one_key(
        settings.curve_secret_key, settings.curve_secret_key_file, "secret", f"{what} secret key"
    )
    server_key = read_one_key(
        getattr(settings, f"{server}_server_key"),
        getattr(settings, f"{server}_server_key_file"),
        "public",
        f"{what}: {server} server key",
    )
    return client_keys(secret, server_key, f"{what} -> {server}")


def open_router(
    ctx: zmq.Context,
    endpoint: str,
    curve: CurveServer | None,
    on_refused: Callable[[str], None],
    what: str,
) -> tuple[zmq.Socket, str, CurveGuard | None]:
    """A bound ROUTER (CURVE + guard when keys are set): (socket, bound endpoint, guard).

    Raises RuntimeError naming the endpoint if it cannot bind (nothing is left open).
    """
    from splitflash.protocol.sockets import bind, make_socket  # sockets imports this module

    guard = CurveGuard(ctx, curve, on_refused) if curve is not None else None
    sock = make_socket(ctx, "router", curve=curve)
    try:
        bound = bind(sock, endpoint)
    except zmq.ZMQError as e:
        sock.close(linger=0)
        if guard is not None:
            guard.stop()
        raise RuntimeError(f"{what} cannot bind {endpoint}: {e}") from e
    if guard is not None:
        guard.watch(sock)
    warn_if_exposed(bound, curve, what)
    return sock, bound, guard
