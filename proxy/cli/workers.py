"""``prefixgate serve --workers N``: N processes serving one port, acting as one router.

``serve`` binds the port once (so a port in use is told before any worker starts) and lets uvicorn's
process supervisor run N workers (a worker that dies is replaced). On Linux (``SO_REUSEPORT``) each
worker listens on a socket of its own bound to that port, and the kernel spreads new connections
evenly over them by their addresses (a worker that dies resets the connections still waiting in
its own queue, which clients retry). One socket shared by every worker would instead go to
whichever worker wakes first, which under a burst of connections takes most of them (measured with
256 keep-alive clients on two workers: splits of 35/65 to 70/30, and once 3/97), leaving one worker
with more sessions than its session memory holds. Only processes of the same user can bind a port
taken this way.

Every worker builds the same app from the same settings, handed over in a file only this user can
read (settings may hold keys). What decides placement is shared through Redis: the given
``--redis-url``, or, without one, an embedded Redis server the supervisor starts on a private unix
socket and stops on exit.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from uvicorn.supervisors import Multiprocess

from proxy.asgi import App
from proxy.config import Settings
from proxy.server import ServingOptions, listen, return_freed_memory, tune_collector, uvicorn_config
from proxy.state.redis.embedded import EmbeddedRedis

log = logging.getLogger("prefixgate")

#: Where a worker finds its settings (a JSON file, mode 0600, removed when the supervisor exits).
SETTINGS_ENV = "PREFIXGATE_WORKER_SETTINGS_FILE"


class SharedPort(socket.socket):
    """The supervisor's claim on the port (bound with ``SO_REUSEPORT``, never listening): a worker
    that receives it (uvicorn hands each worker its sockets by pickling them) gets a listening socket
    of its own on the same address instead of a copy of this one."""

    def __reduce__(self) -> tuple[Any, tuple[str, int]]:
        host, port = self.getsockname()[:2]
        return own_listener, (host, port)


#: Whether this OS spreads one port's connections over several listening sockets: Linux does with
#: ``SO_REUSEPORT``; macOS and most BSDs accept the option but give every connection to one socket.
REUSE_PORT = sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def claim_port(host: str, port: int) -> socket.socket:
    """The supervisor's socket for ``--workers`` where ``REUSE_PORT``: a ``SharedPort``."""
    return listen(host, port, reuse_port=True, kind=SharedPort)


def own_listener(host: str, port: int) -> socket.socket:
    """A worker's own listening socket on the supervisor's port (uvicorn's startup listens on it)."""
    return listen(host, port, reuse_port=True)


def _plain(value: Any) -> Any:
    """``value`` as JSON data, secrets included (``model_dump_json`` masks them)."""
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def worker_app() -> App:
    """The app of one worker process (uvicorn's factory), from the supervisor's settings file."""
    from proxy.app import create_app

    return_freed_memory()  # per process: the supervisor's setting does not reach its workers
    settings = Settings.model_validate(json.loads(Path(os.environ[SETTINGS_ENV]).read_text()))
    app = create_app(settings)
    tune_collector()
    return app


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
