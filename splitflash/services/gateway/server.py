"""`splitflash serve gateway`: load the tokenizer, build the app, run uvicorn."""

from __future__ import annotations

import logging

from splitflash.models import store
from splitflash.models.loading import load_tokenizer
from splitflash.services.common.settings import load_settings, redacted
from splitflash.services.gateway.app import create_app
from splitflash.services.gateway.config import GatewaySettings
from splitflash.services.gateway.runtime import GatewayRuntime

log = logging.getLogger("splitflash.gateway")


def run(overrides: dict | None = None) -> int:
    import uvicorn

    settings = load_settings(GatewaySettings, "SPLITFLASH_GATEWAY_", **(overrides or {}))
    log.info("gateway settings: %s", redacted(settings))
    tokenizer = load_tokenizer(store.resolve(settings.target))
    app = create_app(GatewayRuntime(settings, tokenizer))
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    return 0
