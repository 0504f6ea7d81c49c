"""``cache_salt`` end to end: untouched on its way to the rank, and isolating what the ranks cache.

A recording relay sits between prefixgate and a simulated rank: it keeps the raw bytes of every
request the rank receives and passes everything on unchanged, so the tests see both what prefixgate
sent and what the rank made of it (``cached_tokens``). Canonicalization stays on (the default) and
each system prompt carries trailing spaces, so the body is rewritten on the way: the salt must
survive that rewrite unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.server import ServerThread

# Quotes, a backslash, a control character, non-ASCII and astral code points, and a leading space:
# everything a careless re-encoding or a "normalizing" rule could alter.
SALT = ' tenant-α/"quoted"\\back\tslash-é-e\u0301-🙂 '
OTHER_SALT = "tenant-b"
SYSTEM = "You are a careful coding agent.   \nFollow the repository's conventions.\t\n" * 20


class Relay:
    """Forwards every request to ``upstream`` unchanged and records (path, raw body) of each POST."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.posts: list[tuple[str, bytes]] = []
        self.client = httpx.AsyncClient(base_url=upstream, timeout=20)

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        if request.method == "POST":
            self.posts.append((request.url.path, raw))
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        answer = await self.client.request(
            request.method, request.url.path, params=request.query_params, content=raw, headers=headers
        )
        keep = {k: v for k, v in answer.headers.items() if k.lower() == "content-type"}
        return Response(answer.content, status_code=answer.status_code, headers=keep)

    def app(self) -> Starlette:
        return Starlette(routes=[Route("/{path:path}", self.handle, methods=["GET", "POST", "DELETE"])])

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [orjson.loads(raw) for p, raw in self.posts if p == path]


@pytest.fixture
def relayed(rank_servers, gateway) -> Iterator[Callable[[], tuple[str, Relay]]]:  # type: ignore[no-untyped-def]
    """``relayed()``: prefixgate -> relay -> one simulated rank; returns (prefixgate url, relay)."""
    threads: list[ServerThread] = []

    def start() -> tuple[str, Relay]:
        (rank,) = rank_servers.sim(1, time_scale=0)
        relay = Relay(rank.url)
        thread = ServerThread(relay.app()).start()
        threads.append(thread)
        proxy = gateway([("sim-0", thread.url)], policy="prefix_affinity")
        return proxy.url, relay

    yield start
    for thread in threads:
        thread.stop()


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    # orjson writes non-ASCII as raw UTF-8: the exact bytes the rank must receive for the salt
    answer = httpx.post(
        url + path, content=orjson.dumps(body), headers={"content-type": "application/json"}, timeout=20
    )
    assert answer.status_code == 200, answer.text
    return answer.json()


def chat_body(salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "prefixgate-sim",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files under src/ and explain the layout. " * 8},
        ],
        "max_tokens": 4,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def responses_body(salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "prefixgate-sim",
        "instructions": SYSTEM,
        "input": "List the files under src/ and explain the layout. " * 8,
        "store": False,
        "max_output_tokens": 4,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def messages_body(salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "prefixgate-sim",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "List the files under src/ and explain the layout. " * 8}],
        "max_tokens": 4,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def assert_salt_untouched(relay: Relay, path: str) -> None:
    (raw,) = [raw for p, raw in relay.posts if p == path]
    forwarded = orjson.loads(raw)
    assert forwarded["cache_salt"] == SALT
    assert orjson.dumps(SALT) in raw  # the salt's own bytes, as the client encoded them
    # canonicalization did run on this body: the salt survived a rewrite, not a pass-through
    system = forwarded.get("instructions") or forwarded.get("system") or forwarded["messages"][0]["content"]
    assert system != SYSTEM and "   \n" not in system


@pytest.mark.parametrize(
    ("path", "make"),
    [
        ("/v1/chat/completions", chat_body),
        ("/v1/responses", responses_body),
        ("/v1/messages", messages_body),
    ],
)
def test_cache_salt_reaches_the_rank_untouched(relayed, path, make):  # type: ignore[no-untyped-def]
    url, relay = relayed()
    post(url, path, make(SALT))
    assert_salt_untouched(relay, path)


def cached_chat(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def cached_responses(answer: dict[str, Any]) -> int:
    return int(answer["usage"]["input_tokens_details"]["cached_tokens"])


@pytest.mark.parametrize(
    ("path", "make", "cached"),
    [("/v1/chat/completions", chat_body, cached_chat), ("/v1/responses", responses_body, cached_responses)],
)
def test_salted_requests_share_blocks_only_within_their_salt(relayed, path, make, cached):  # type: ignore[no-untyped-def]
    url, _ = relayed()
    assert cached(post(url, path, make(SALT))) == 0
    # the same prompt under another salt, or none, shares nothing with it on the rank
    assert cached(post(url, path, make(OTHER_SALT))) == 0
    assert cached(post(url, path, make(None))) == 0
    # each salt (and no salt) hits its own blocks again
    repeat = cached(post(url, path, make(SALT)))
    assert repeat > 0
    assert cached(post(url, path, make(OTHER_SALT))) == repeat
    assert cached(post(url, path, make(None))) == repeat


@pytest.mark.parametrize(
    ("path", "make", "cached"),
    [("/v1/chat/completions", chat_body, cached_chat), ("/v1/responses", responses_body, cached_responses)],
)
def test_prefixgate_predicts_hits_per_salt_as_the_rank_reports_them(relayed, path, make, cached):  # type: ignore[no-untyped-def]
    """prefixgate's own block hashes carry the salt: its index sees no hit across salts."""
    url, _ = relayed()

    def estimate_and_cached(salt: str | None) -> tuple[int, int]:
        answer = httpx.post(url + path, json=make(salt), timeout=20)
        assert answer.status_code == 200, answer.text
        return int(answer.headers["x-prefixgate-estimated-cached-tokens"]), cached(answer.json())

    assert estimate_and_cached(SALT) == (0, 0)
    assert estimate_and_cached(OTHER_SALT) == (0, 0)
    estimate, hit = estimate_and_cached(SALT)
    assert hit > 0 and estimate == hit
