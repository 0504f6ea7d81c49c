"""Redis behind a password, and ``rediss://`` URLs, for all three things prefixgate keeps in Redis.

The prefix index, the session table and the Responses id -> rank map all take their connection from
``--redis-url``; a password in the URL (``redis://:pw@host:port/db``) must reach every one of them.
The redis-server here is built without TLS (``--tls-port`` is an unknown directive), so TLS itself
cannot be tested end to end: a ``rediss://`` URL is checked to be accepted, and a plain server behind
it to be reported clearly instead of failing requests.
"""

from __future__ import annotations

import logging

import httpx
import pytest
import redis

from proxy.state.redis.responses import REDIS_PREFIX
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until
from tests.reliability.conftest import chat, post_turns

PASSWORD = "s3cret:/@pw"  # URL-special characters, percent-encoded in the URL
QUOTED = "s3cret%3A%2F%40pw"


def redis_up(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("prefixgate_index_redis_up "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("prefixgate_index_redis_up not exported")


def protect(server: RedisServer) -> redis.Redis:
    """Turn on ``requirepass`` on the test's server; returns a client that authenticates."""
    plain = redis.Redis(port=server.port, socket_timeout=2)
    plain.config_set("requirepass", PASSWORD)
    plain.close()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=server.port, socket_timeout=2).ping()
    return redis.Redis(port=server.port, password=PASSWORD, socket_timeout=2)


def keys(client: redis.Redis, pattern: str) -> list[bytes]:
    return list(client.scan_iter(match=pattern, count=1000))


def logged_while_serving(  # type: ignore[no-untyped-def]
    caplog, gateway, ranks, redis_url: str, word: str, still_up: str
) -> str:
    """Two chats through prefixgate on a Redis it cannot use: both answered, the index reports Redis
    down (else the test fails with ``still_up``). Returns what was logged at WARNING and above."""
    with caplog.at_level(logging.WARNING):
        proxy = gateway(ranks, policy="prefix_affinity", redis_url=redis_url)
        for turn in range(2):
            answer = httpx.post(
                proxy.url + "/v1/chat/completions", json=chat(f"{word} {turn} " * 40), timeout=15
            )
            assert answer.status_code == 200, answer.text
        wait_until(lambda: redis_up(proxy.url) == 0.0, still_up)
    return "\n".join(r.getMessage() for r in caplog.records)


def test_password_in_the_url_reaches_index_sessions_and_response_map(rank_servers, gateway, redis_server):  # type: ignore[no-untyped-def]
    authed = protect(redis_server)
    ranks = rank_servers.sim(2)
    url = f"redis://:{QUOTED}@127.0.0.1:{redis_server.port}/0"
    proxy = gateway(ranks, policy="prefix_affinity", redis_url=url)
    post_turns(proxy.url, "password test " * 60, "pw-session")
    stored = httpx.post(
        proxy.url + "/v1/responses",
        json={"model": "prefixgate-sim", "input": "remember me " * 30, "max_output_tokens": 4, "store": True},
        timeout=15,
    )
    assert stored.status_code == 200, stored.text
    response_id = stored.json()["id"]

    # the response map and the session table write synchronously, the index from its writer thread
    assert authed.get(REDIS_PREFIX + response_id) == stored.headers["x-prefixgate-backend"].encode()
    wait_until(lambda: any(b"pw-session" in k for k in keys(authed, "prefixgate:sessions:*")), "no session")
    wait_until(lambda: len(keys(authed, "prefixgate:*")) > 3, "no index records")
    index_keys = [
        k
        for k in keys(authed, "prefixgate:*")
        if not k.startswith((b"prefixgate:sessions:", REDIS_PREFIX.encode()))
    ]
    assert index_keys, "the prefix index wrote nothing to Redis"
    assert redis_up(proxy.url) == 1.0

    # a second replica with the same URL reads all three back through the password
    second = gateway(ranks, policy="prefix_affinity", redis_url=url)
    sessions = httpx.get(second.url + "/admin/sessions", timeout=5).json()["data"]
    assert "pw-session" in {row["id"] for row in sessions}
    follow = httpx.post(
        second.url + "/v1/responses",
        json={
            "model": "prefixgate-sim",
            "input": "and then?",
            "previous_response_id": response_id,
            "max_output_tokens": 4,
        },
        timeout=15,
    )
    assert follow.status_code == 200, follow.text
    assert follow.headers["x-prefixgate-backend"] == stored.headers["x-prefixgate-backend"]
    again = httpx.post(
        second.url + "/v1/chat/completions",
        json=chat("password test " * 60 + "turn 2"),
        headers={"x-session-id": "pw-session"},
        timeout=15,
    )
    assert again.status_code == 200
    assert redis_up(second.url) == 1.0


@pytest.mark.parametrize(
    ("credentials", "finding"),
    [(":not-this-one@", "refused the credentials"), ("", "requires a password: use redis://:PASSWORD@")],
)
def test_a_wrong_or_missing_password_is_named_and_requests_still_succeed(  # type: ignore[no-untyped-def]
    rank_servers, gateway, redis_server, caplog, credentials, finding
):
    protect(redis_server)
    url = f"redis://{credentials}127.0.0.1:{redis_server.port}/0"
    logged = logged_while_serving(
        caplog, gateway, rank_servers.sim(1), url, "turn", "the index still claims Redis is up"
    )
    assert finding in logged, logged
    assert "not-this-one" not in logged  # the password itself is never logged


def test_rediss_url_is_accepted_and_a_plain_server_is_reported_clearly(  # type: ignore[no-untyped-def]
    rank_servers, gateway, redis_server, caplog
):
    url = f"rediss://127.0.0.1:{redis_server.port}/0"
    down = "the index claims a TLS Redis behind a plain server"
    logged = logged_while_serving(caplog, gateway, rank_servers.sim(1), url, "tls", down)
    assert "speaks plain Redis, not TLS" in logged, logged
