"""`python -m splitflash.services.draft`: run the draft service until SIGTERM/SIGINT.

Settings come from SPLITFLASH_DRAFT_* (see config.py); `run(**overrides)` is what
`splitflash serve draft` calls with its command-line flags.
"""

from __future__ import annotations

import sys

from splitflash.services.common.worker_main import configure_logging, run_worker
from splitflash.services.draft.config import ENV_PREFIX, DraftSettings


def _server(settings: DraftSettings):
    from splitflash.services.draft.server import DraftServer  # loads torch and the model

    return DraftServer(settings)


def run(**overrides) -> int:
    return run_worker("draft", DraftSettings, ENV_PREFIX, _server, overrides)


def main() -> int:
    configure_logging()
    return run()


if __name__ == "__main__":
    sys.exit(main())
