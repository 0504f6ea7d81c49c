"""A throw-away redis-server on a loopback port, for every suite that needs a real Redis."""

from __future__ import annotations

import subprocess

import redis

from proxy.server import free_port
from proxy.state.embedded_redis import redis_binary
from tests.helpers.wait import wait_until


class RedisServer:
    """A redis-server without persistence that tests can kill and start again on the same port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server and wait (10 s at most) until it answers PING."""
        self.proc = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis(port=self.port, socket_timeout=0.5)
        try:
            wait_until(
                client.ping,
                "redis-server did not start",
                timeout=10,
                interval=0.02,
                retry_on=(redis.RedisError,),
            )
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: no shutdown save); a later ``start`` comes back empty."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None

    kill = stop  # the name the fault tests use: the server is killed, not shut down
