"""The replay client retries what the openai SDK retries: a connection refused before any answer and
429/502/503/504 answers; a stream cut after it began is an error, not retried."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from bench.chat_stream import post_with_retries
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until_async

BODY = {
    "model": "stub-model",
    "messages": [{"role": "user", "content": "hello"}],
    "stream": True,
    "stream_options": {"include_usage": True},
}


async def test_a_gateway_error_is_retried(rank_servers: RankServers) -> None:
    (rank,) = rank_servers.stub(1, status=502)
    async with aiohttp.ClientSession() as http:
        sent = asyncio.ensure_future(post_with_retries(http, rank.url, BODY, "s", 50, 0.2))
        await wait_until_async(lambda: len(rank.behavior.received) >= 1, timeout=20.0)
        rank.behavior.status = None  # the gateway recovers
        out, rejections = await asyncio.wait_for(sent, 30)
    assert rejections >= 1 and out.content


async def test_a_refused_connection_is_retried(rank_servers: RankServers) -> None:
    (rank,) = rank_servers.stub(1)
    rank.stop()  # nothing listens: the connection is refused
    async with aiohttp.ClientSession() as http:
        sent = asyncio.ensure_future(post_with_retries(http, rank.url, BODY, "s", 50, 0.2))
        await asyncio.sleep(0.3)
        assert not sent.done()
        await asyncio.to_thread(rank.restart)
        out, rejections = await asyncio.wait_for(sent, 30)
    assert rejections >= 1 and out.content


async def test_a_stream_cut_after_it_began_is_not_retried(rank_servers: RankServers) -> None:
    (rank,) = rank_servers.stub(1, die_after=1)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientError):
            await post_with_retries(http, rank.url, BODY, "s", 50, 0.2)
    assert len(rank.behavior.received) == 1
