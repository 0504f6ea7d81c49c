"""``prefixgate serve --workers N``: N processes serving one port, acting as one router.

``serve`` binds the listening socket once and lets uvicorn's process supervisor run N workers
on it (the kernel deals connections out; a worker that dies is replaced). Every worker builds the
same app from the same settings, handed over in a file only this user can read (settings may hold
keys). What decides placement is shared through Redis: the given ``--redis-url``, or, without one,
an embedded Redis server the supervisor starts on a private unix socket and stops on exit.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from pydantic import SecretStr
from uvicorn.supervisors import Multiprocess

from proxy.config import Settings
from proxy.server import ServingOptions, return_freed_memory, uvicorn_config
from proxy.state.embedded_redis import EmbeddedRedis

log = logging.getLogger("prefixgate")

#: Where a worker finds its settings (a JSON file, mode 0600, removed when the supervisor exits).
SETTINGS_ENV = "PREFIXGATE_WORKER_SETTINGS_FILE"


def _plain(value: Any) -> Any:
    """``value`` as JSON data, secrets included (``model_dump_json`` masks them)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def worker_app() -> FastAPI:
    """The app of one worker process (uvicorn's factory), from the supervisor's settings file."""
    from proxy.app import create_app

    return_freed_memory()  # per process: the supervisor's setting does not reach its workers
    settings = Settings.model_validate(json.loads(Path(os.environ[SETTINGS_ENV]).read_text()))
    return create_app(settings)


def run_workers(settings: Settings, listener: socket.socket) -> int:
    """Serve ``settings`` from ``settings.workers`` processes on ``listener`` (bound) until SIGTERM
    or SIGINT."""
    embedded: EmbeddedRedis | None = None
    if not settings.redis_url:
        embedded = EmbeddedRedis().start()
        settings = settings.model_copy(update={"redis_url": embedded.url})
        log.info("workers share state through an embedded Redis server at %s", embedded.socket)
    handle, path = tempfile.mkstemp(prefix="prefixgate-settings-", suffix=".json")
    try:
        with os.fdopen(handle, "w") as out:  # mkstemp: mode 0600
            json.dump(_plain(settings.model_dump()), out)
        os.environ[SETTINGS_ENV] = path
        config = uvicorn_config(
            "proxy.cli.workers:worker_app",
            settings.host,
            settings.port,
            settings.log_level,
            settings.event_loop,
            ServingOptions.from_settings(settings),  # the factory's app is not built here to ask
            graceful_shutdown=settings.shutdown_timeout,
        )
        config.factory = True
        config.workers = settings.workers
        log.info("prefixgate: %d workers on %s:%d", settings.workers, settings.host, settings.port)
        Multiprocess(config, sockets=[listener]).run()
    finally:
        os.unlink(path)
        if embedded is not None:
            embedded.stop()
    return 0
