"""`python -m splitflash.services.draft`: run the draft service until SIGTERM/SIGINT.

Settings come from SPLITFLASH_DRAFT_* (see config.py); `run(**overrides)` is what
`splitflash serve draft` calls with its command-line flags.
"""

from __future__ import annotations

import logging
import signal
import sys

from splitflash.services.common.settings import load_settings, redacted
from splitflash.services.draft.config import ENV_PREFIX, DraftSettings

log = logging.getLogger("splitflash.draft")


def _set_title(title: str) -> None:
    """Name the process in ps/top when setproctitle is installed (optional dependency)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def run(**overrides) -> int:
    settings = load_settings(DraftSettings, ENV_PREFIX, **overrides)
    _set_title(f"splitflash-draft {settings.bind}")
    log.info("settings: %s", redacted(settings))
    from splitflash.services.draft.server import DraftServer

    server = DraftServer(settings)
    # The loop checks the flag every 100 ms; the handlers only set it, so a step in flight
    # finishes and the sockets close cleanly (linger 0) in serve()'s finally.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(
            sig, lambda signum, _frame: (log.info("signal %d: stopping", signum), server.stop())
        )
    server.serve()
    log.info("draft stopped")
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
