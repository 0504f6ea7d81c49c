"""``GET /v1/models``: the union of the healthy ranks' model cards (the first rank's card wins per id),
cached for ``models_cache_ttl`` seconds."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
from starlette.responses import Response

from proxy.errors import NO_BACKEND, ProxyError, error_response
from proxy.unavailable import no_rank
from routing.ranks import Fleet, Rank

JSON = "application/json"


def json_response(data: Any, status: int = 200, rank: str = NO_BACKEND) -> Response:
    return Response(
        orjson.dumps(data), status_code=status, media_type=JSON, headers={"x-prefixgate-backend": rank}
    )


async def fetch_models(client: aiohttp.ClientSession, rank: Rank, timeout_s: float) -> list[Any] | None:
    """The rank's ``/v1/models`` cards (None when it does not answer with a list)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with client.get(f"{rank.url}/v1/models", timeout=timeout) as response:
            if response.status != 200:
                return None
            data = orjson.loads(await response.read()).get("data")
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
        return None
    return data if isinstance(data, list) else None


class Models:
    """The merged model list of the fleet."""

    def __init__(self, fleet: Fleet, cache_ttl: float, timeout_s: float) -> None:
        self.fleet = fleet
        self.cache_ttl = cache_ttl
        self.timeout_s = timeout_s
        self._cached: tuple[float, dict[str, Any], str] | None = None

    async def __call__(self, client: aiohttp.ClientSession) -> Response:
        now = time.monotonic()
        cached = self._cached
        if cached is not None and now - cached[0] < self.cache_ttl:
            return json_response(cached[1], rank=cached[2])
        ranks = self.fleet.healthy()
        if not ranks:
            return error_response(no_rank(self.fleet, "GET /v1/models"))
        answers = await asyncio.gather(*(fetch_models(client, r, self.timeout_s) for r in ranks))
        cards: dict[str, Any] = {}
        answered: list[str] = []
        for rank, data in zip(ranks, answers, strict=True):
            if data is None:
                continue
            answered.append(rank.name)
            rank.models = [c["id"] for c in data if isinstance(c, dict) and "id" in c]
            for card in data:
                if isinstance(card, dict) and "id" in card:
                    cards.setdefault(card["id"], card)
        if not answered:
            return error_response(
                ProxyError(
                    502, "no backend answered /v1/models", type_="upstream_error", code="upstream_failed"
                )
            )
        body = {"object": "list", "data": list(cards.values())}
        names = ",".join(answered)
        self._cached = (now, body, names)
        return json_response(body, rank=names)
