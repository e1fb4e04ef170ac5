"""`python -m splitflash.services.verify`: run the verify service until SIGTERM/SIGINT.

Settings come from SPLITFLASH_VERIFY_* (see config.py); `run(**overrides)` is what
`splitflash serve verify` calls with its command-line flags.
"""

from __future__ import annotations

import logging
import signal
import sys

from splitflash.services.common.settings import load_settings, redacted
from splitflash.services.verify.config import ENV_PREFIX, VerifySettings

log = logging.getLogger("splitflash.verify")


def _set_title(title: str) -> None:
    """Name the process in ps/top when setproctitle is installed (optional dependency)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def run(**overrides) -> int:
    settings = load_settings(VerifySettings, ENV_PREFIX, **overrides)
    _set_title(f"splitflash-verify {settings.bind}")
    log.info("settings: %s", redacted(settings))
    from splitflash.services.verify.server import VerifyServer

    server = VerifyServer(settings)
    # The loop checks the flag every 100 ms; the handlers only set it, so a step in flight
    # finishes and the sockets close cleanly (linger 0) in serve()'s finally.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(
            sig, lambda signum, _frame: (log.info("signal %d: stopping", signum), server.stop())
        )
    server.serve()
    log.info("verify stopped")
    return 0


def main() -> int:
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return run()


if __name__ == "__main__":
    sys.exit(main())
