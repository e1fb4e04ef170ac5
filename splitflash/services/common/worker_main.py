"""The one start-up path of both workers: settings, process title, signals, serve."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable

from splitflash.services.common.settings import load_settings, redacted


def _set_title(title: str) -> None:
    """Name the process in ps/top when setproctitle is installed (optional dependency)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def run_worker(
    name: str, settings_cls: type, env_prefix: str, make_server: Callable, overrides: dict
) -> int:
    log = logging.getLogger(f"splitflash.{name}")
    settings = load_settings(settings_cls, env_prefix, **overrides)
    _set_title(f"splitflash-{name} {settings.bind}")
    log.info("settings: %s", redacted(settings))
    server = make_server(settings)
    # The loop checks the flag every 100 ms; the handlers only set it, so a step in flight
    # finishes and the sockets close cleanly (linger 0) in serve()'s finally.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(
            sig, lambda signum, _frame: (log.info("signal %d: stopping", signum), server.stop())
        )
    server.serve()
    log.info("%s stopped", name)
    return 0


def configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
