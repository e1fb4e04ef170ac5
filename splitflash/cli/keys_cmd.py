"""`splitflash keys generate DIR`: CURVE keypairs for the gateway, verify and draft.

Writes ZeroMQ certificates (`NAME.key` public, `NAME.key_secret` secret, mode 0600) and
`curve.env`, the environment that turns CURVE on everywhere, for `docker compose
--env-file DIR/curve.env up` or `set -a; . DIR/curve.env`: each service's secret key, the
client keys each server lets in (verify: the gateway; draft: the gateway and verify) and the
server keys each client trusts. Keep the directory private: the secret keys are in it.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ROLES = ("gateway", "verify", "draft")


def register(sub) -> None:
    keys = sub.add_parser("keys", help="CURVE keys for authenticated, encrypted transport")
    actions = keys.add_subparsers(dest="action", required=True)
    gen = actions.add_parser("generate", help="keypairs + curve.env into DIR")
    gen.add_argument("dir", type=Path, help="output directory (created, must not hold keys)")
    gen.add_argument("--force", action="store_true", help="overwrite existing keys")
    gen.set_defaults(run=_run_generate)


def curve_env(public: dict[str, str], secret: dict[str, str]) -> dict[str, str]:
    """The SPLITFLASH_* variables of a CURVE deployment, from each role's Z85 keys."""
    return {
        "SPLITFLASH_GATEWAY_CURVE_SECRET_KEY": secret["gateway"],
        "SPLITFLASH_GATEWAY_VERIFY_SERVER_KEY": public["verify"],
        "SPLITFLASH_GATEWAY_DRAFT_SERVER_KEY": public["draft"],
        "SPLITFLASH_VERIFY_CURVE_SECRET_KEY": secret["verify"],
        "SPLITFLASH_VERIFY_CURVE_CLIENT_KEYS": public["gateway"],
        "SPLITFLASH_VERIFY_DRAFT_SERVER_KEY": public["draft"],
        "SPLITFLASH_DRAFT_CURVE_SECRET_KEY": secret["draft"],
        "SPLITFLASH_DRAFT_CURVE_CLIENT_KEYS": f"{public['gateway']},{public['verify']}",
    }


def generate(out: Path, force: bool = False) -> Path:
    import zmq

    out.mkdir(parents=True, exist_ok=True)
    env_file = out / "curve.env"
    if env_file.exists() and not force:
        raise FileExistsError(f"{env_file} exists; pass --force to replace these keys")
    public, secret = {}, {}
    for role in ROLES:
        pub, sec = zmq.curve_keypair()
        public[role], secret[role] = pub.decode(), sec.decode()
        (out / f"{role}.key").write_text(f'curve\n    public-key = "{public[role]}"\n')
        _write_private(
            out / f"{role}.key_secret",
            f'curve\n    public-key = "{public[role]}"\n    secret-key = "{secret[role]}"\n',
        )
    lines = [f"{k}={v}" for k, v in curve_env(public, secret).items()]
    # Z85 has no quote, space or "$", so the values need no quoting in an env file
    _write_private(env_file, "# CURVE keys for splitflash (secret!)\n" + "\n".join(lines) + "\n")
    return env_file


def _write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _run_generate(args: argparse.Namespace) -> int:
    env_file = generate(args.dir, args.force)
    print(f"keys for {', '.join(ROLES)} in {args.dir}; environment in {env_file}")
    return 0
