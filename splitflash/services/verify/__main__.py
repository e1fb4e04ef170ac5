"""`python -m splitflash.services.verify`: run the verify service until SIGTERM/SIGINT.

Settings come from SPLITFLASH_VERIFY_* (see config.py); `run(**overrides)` is what
`splitflash serve verify` calls with its command-line flags.
"""

from __future__ import annotations

import sys

from splitflash.services.common.worker_main import configure_logging, run_worker
from splitflash.services.verify.config import ENV_PREFIX, VerifySettings


def _server(settings: VerifySettings):
    from splitflash.services.verify.server import VerifyServer  # loads torch and the model

    return VerifyServer(settings)


def run(**overrides) -> int:
    return run_worker("verify", VerifySettings, ENV_PREFIX, _server, overrides)


def main() -> int:
    configure_logging()
    return run()


if __name__ == "__main__":
    sys.exit(main())
