"""Replay conversations given as every turn's whole request body (``bench.agent_shapes``: an agent's
drift between requests fixed in advance), as ``bench.replay.replay`` does for answer-driven sessions."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.chat_stream import Rejected, post_chat_stream
from bench.replay import ReplayResult, turn_result


async def replay_bodies(
    url: str, sessions: Sequence[Sequence[dict[str, Any]]], model: str, key: str, max_tokens: int = 8
) -> ReplayResult:
    """Conversations given as every turn's whole body (an agent's drift included, fixed in advance)
    against ``url``: streamed, session ``KEY-i`` each, sessions concurrently and turns in order."""
    result = ReplayResult()
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def run(index: int, turns: Sequence[dict[str, Any]]) -> None:
            session = f"{key}-{index}"
            for turn, body in enumerate(turns):
                body = {**body, "model": model, "stream": True, "max_tokens": max_tokens}
                body["stream_options"] = {"include_usage": True}
                result.requests.append(body)
                sent_s = time.perf_counter() - start
                try:
                    out = await post_chat_stream(http, url, body, session)
                except Exception as exc:  # recorded; the session stops like an agent's would
                    result.refused += isinstance(exc, Rejected)
                    result.errors.append(f"{session} turn {turn}: {exc}")
                    return
                result.turns.append(turn_result(session, turn, out, sent_s))

        await asyncio.gather(*(run(i, s) for i, s in enumerate(sessions)))
    result.wall_s = time.perf_counter() - start
    return result
