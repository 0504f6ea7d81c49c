"""A rank's facts follow the rank (``routing.rank_facts``): prefixgate started before its ranks learns
each one when it comes up (tokenizer, pool, KV-event subscription), a rank restarted with another
pool is re-read, and replicas that started at different moments agree on one index namespace."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

import routing.rank_facts
from bench.sim import SimConfig, SimRankServer
from proxy.gateway import Gateway
from proxy.server import ServerThread, free_port
from tests.helpers.gateway import gateway_app
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until

SIM = SimConfig(time_scale=0, block_size=16)


@dataclass
class Proxy:
    server: ServerThread
    gateway: Gateway

    @property
    def url(self) -> str:
        return self.server.url

    def ready(self) -> tuple[int, dict[str, Any]]:
        answer = httpx.get(self.url + "/ready")
        return answer.status_code, answer.json()


class Started:
    """Every sim and proxy a test starts, stopped after it (proxies first)."""

    def __init__(self) -> None:
        self.sims: list[SimRankServer] = []
        self.proxies: list[Proxy] = []
        self.gates: list[threading.Event] = []

    def sim(self, name: str, port: int, **config: Any) -> SimRankServer:
        rank = SimRankServer(SimConfig(**{**SIM.__dict__, "name": name, "port": port, **config}))
        self.sims.append(rank.start())
        return rank

    def proxy(self, ranks: list[tuple[str, str]], **flags: Any) -> Proxy:
        app = gateway_app(ranks, **{"health_timeout": 1.0, **flags})
        started = Proxy(ServerThread(app).start(), app.state.gateway)
        self.proxies.append(started)
        return started

    def stop(self) -> None:
        for gate in self.gates:  # what a failed test left held
            gate.set()
        for started in self.proxies:
            started.server.stop()
        for rank in self.sims:
            rank.stop()


@pytest.fixture
def started() -> Iterator[Started]:
    servers = Started()
    yield servers
    servers.stop()


def prefixgate_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """prefixgate's log lines (admission's aside: proxy/admission is reworded on its own)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("prefixgate") and not r.name.startswith("prefixgate.admission")
    ]


def test_a_rank_started_after_prefixgate_is_learned_when_it_comes_up(
    started: Started, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate")
    port = free_port()
    # Readings of the rank's facts wait for the test's word: /ready is seen degraded in between.
    gate = threading.Event()
    started.gates.append(gate)
    read = routing.rank_facts.read_facts

    async def held_read(*args: Any, **kwargs: Any) -> routing.rank_facts.RankFacts:
        await asyncio.to_thread(gate.wait, 30)
        return await read(*args, **kwargs)

    monkeypatch.setattr(routing.rank_facts, "read_facts", held_read)
    # Only becoming healthy can teach the facts here: the periodic re-reading is an hour away.
    proxy = started.proxy(
        [("sim-0", f"http://127.0.0.1:{port}")],
        kv_events="auto",
        health_interval=0.2,
        rank_facts_interval=3600,
    )
    gateway = proxy.gateway
    assert proxy.ready()[0] == 503
    rank = gateway.fleet.get("sim-0")
    assert rank is not None and rank.pool_tokens is None
    assert gateway.tokenizer is not None and gateway.tokenizer.asked is None
    assert gateway.kv_feeds == ()
    assert (
        "kv_events auto: rank sim-0 is not up yet; its KV events are followed once it is"
        in prefixgate_lines(caplog)
    )

    sim = started.sim("sim-0", port, kv_events=True, num_blocks=5000)
    status, body = wait_until(lambda: (r := proxy.ready())[0] == 200 and r, "never became ready")
    assert status == 200 and body["status"] == "degraded"
    assert body["missing"] == {
        "sim-0": ["model", "block size", "pool size", "KV-event subscription", "tokenizer"]
    }

    gate.set()
    wait_until(lambda: proxy.ready()[1]["status"] == "ready", lambda: f"still {proxy.ready()[1]}")
    assert proxy.ready() == (200, {"status": "ready", "healthy_backends": ["sim-0"]})
    assert rank.pool_tokens == 5000 * 16 and rank.block_size == 16
    assert gateway.tokenizer.asked == "sim-0"
    assert gateway.pipeline is not None and gateway.pipeline.blocks.incremental is gateway.tokenizer.current
    (feed,) = gateway.kv_feeds
    assert sim.rank.publisher is not None and feed.endpoint == sim.rank.publisher.endpoint
    assert gateway.router is not None and "sim-0" in gateway.router.exact

    # The subscription works: the rank's events reach this replica's mirror.
    answer = httpx.post(
        proxy.url + "/v1/chat/completions",
        json={"model": SIM.model, "messages": [{"role": "user", "content": "tell me a story " * 40}]},
        headers={"x-session-id": "late-1"},
    )
    assert answer.status_code == 200
    kv_events = gateway.metrics.kv_events
    wait_until(
        lambda: kv_events.labels("sim-0", "BlockStored")._value.get() > 0, "no KV event reached the mirror"
    )

    lines = prefixgate_lines(caplog)
    learned = [line for line in lines if line.startswith("rank sim-0 serves model")]
    assert learned == [
        f"rank sim-0 serves model {SIM.model}, has KV blocks of 16 tokens, has a KV pool of 80,000 tokens "
        f"and publishes KV events at {feed.endpoint} (first reading)"
    ]
    assert any(line.startswith("tokenizer: ") and line.endswith("(asked rank sim-0)") for line in lines)
    assert not [line for line in lines if "None" in line]
    assert not [line for line in lines if "--kv-events-config" in line]  # the rank was not up: no blame


def test_a_rank_restarted_with_another_pool_is_read_again(
    started: Started, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate")
    port = free_port()
    first = started.sim("sim-0", port, num_blocks=4000)
    # The health checker never sees it down (an hour between checks): the periodic re-reading must.
    proxy = started.proxy([("sim-0", first.url)], health_interval=3600, rank_facts_interval=0.2)
    rank = proxy.gateway.fleet.get("sim-0")
    assert rank is not None and rank.pool_tokens == 4000 * 16
    first.stop()
    started.sim("sim-0", port, num_blocks=2500)
    wait_until(lambda: rank.pool_tokens == 2500 * 16, lambda: f"pool still {rank.pool_tokens}")
    assert "rank sim-0 has a KV pool of 40,000 tokens now (was 64,000)" in prefixgate_lines(caplog)
    assert proxy.ready() == (200, {"status": "ready", "healthy_backends": ["sim-0"]})


def test_replicas_started_at_different_moments_agree_on_the_index_namespace(
    started: Started, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="prefixgate")
    port_a, port_b = free_port(), free_port()
    ranks = [("sim-a", f"http://127.0.0.1:{port_a}"), ("sim-b", f"http://127.0.0.1:{port_b}")]
    flags = {"redis_url": redis_server.url, "health_interval": 0.2, "rank_facts_interval": 3600}
    # Replica 1 starts before any rank: no model to propose, nothing agreed yet.
    one = started.proxy(ranks, **flags)
    assert not one.gateway.namespace.settled
    # sim-b comes up first: replica 1 proposes its model, the first proposal.
    started.sim("sim-b", port_b, model="model-b")
    wait_until(lambda: one.gateway.namespace.settled, "replica 1 never agreed a namespace")
    # Later, sim-a is up too: replica 2 starts and asks sim-a first, which serves another model.
    started.sim("sim-a", port_a, model="model-a")
    two = started.proxy(ranks, **flags)

    assert one.gateway.namespace.current == two.gateway.namespace.current == "model-b"
    client = redis.Redis.from_url(redis_server.url)
    assert client.get("prefixgate:index-namespace") == b"model-b"
    lines = prefixgate_lines(caplog)
    assert "prefix index namespace model-b, agreed through the shared state" in lines
    assert (
        "prefix index namespace model-b, agreed by another replica first (the ranks here serve model-a)"
        in lines
    )

    # What each replica records lands in the one namespace.
    for proxy, session in ((one, "ns-1"), (two, "ns-2")):
        answer = httpx.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "model-b", "messages": [{"role": "user", "content": f"{session} " * 200}]},
            headers={"x-session-id": session},
        )
        assert answer.status_code == 200, answer.text
    wait_until(lambda: client.keys("prefixgate:model-b:*lru:*"), "no index entry written")
    index_keys = [k.decode() for k in client.keys("prefixgate:*:lru:*")]
    assert index_keys and all(k.startswith("prefixgate:model-b:") for k in index_keys), index_keys
