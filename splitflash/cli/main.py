"""`splitflash` command line: one subcommand per job, each in its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from splitflash.cli import (
    bench_cmd,
    doctor_cmd,
    generate,
    keys_cmd,
    models_cmd,
    serve_cmd,
    train_cmd,
    up_cmd,
)

COMMANDS = [models_cmd, generate, up_cmd, serve_cmd, train_cmd, bench_cmd, doctor_cmd, keys_cmd]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitflash", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
