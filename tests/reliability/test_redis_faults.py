"""Redis killed and restarted under traffic; a prefixgate replica restarted with Redis configured."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from proxy.server import free_port
from tests.reliability.conftest import chat, sse_events

REDIS = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS is None, reason="redis-server is not installed")


class RedisServer:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        assert REDIS is not None
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            self.proc = None


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.kill()


def converse(url: str, session: str, turns: int) -> list[str]:
    """``turns`` streamed requests of one session; the rank of each (all must succeed)."""
    used = []
    for turn in range(turns):
        body = chat(f"{session} turn {turn}: " + "context " * 40, stream=turn % 2 == 0)
        response = httpx.post(
            url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=15
        )
        assert response.status_code == 200, response.text
        if turn % 2 == 0:
            assert sse_events(response.text)[-1] == "[DONE]"
        used.append(response.headers["x-prefixgate-backend"])
    return used


def redis_up(url: str) -> str:
    metrics = httpx.get(url + "/metrics", timeout=5).text
    return next(line for line in metrics.splitlines() if line.startswith("prefixgate_index_redis_up"))


def test_redis_killed_and_restarted_during_traffic(sims, gateway, redis_server):
    ranks = sims(2)
    proxy = gateway([(r.name, r.url) for r in ranks], policy="prefix_affinity", redis_url=redis_server.url)
    before = converse(proxy.url, "s-a", 3)
    redis_server.kill()
    during = converse(proxy.url, "s-a", 3) + converse(proxy.url, "s-b", 3)
    assert redis_up(proxy.url).endswith(" 0.0")
    assert during[:3] == [before[0]] * 3  # the local mirror keeps the session on its rank
    redis_server.start()
    deadline = time.monotonic() + 20
    while not redis_up(proxy.url).endswith(" 1.0"):
        converse(proxy.url, "s-c", 1)
        assert time.monotonic() < deadline, "prefixgate did not reconnect to Redis"
        time.sleep(0.2)
    assert converse(proxy.url, "s-a", 2) == [before[0]] * 2


def test_replica_restart_keeps_sessions_on_their_rank(sims, gateway, redis_server):
    ranks = sims(2)
    backends = [(r.name, r.url) for r in ranks]
    first = gateway(backends, policy="prefix_affinity", redis_url=redis_server.url)
    sessions = {f"s-{i}": converse(first.url, f"s-{i}", 2)[-1] for i in range(4)}
    first.stop()
    time.sleep(0.5)  # the index writer flushes on shutdown
    second = gateway(backends, policy="prefix_affinity", redis_url=redis_server.url)
    for session, rank in sessions.items():
        assert converse(second.url, session, 2) == [rank, rank], session
