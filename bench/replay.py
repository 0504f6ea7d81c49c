"""Drive agent sessions against an OpenAI endpoint and measure what the ranks report.

Hit rate and prefill are computed from the ranks' own ``usage`` (``cached_tokens``), never from
prefixgate's estimates. Each session runs its turns in order (a turn waits for the previous answer);
sessions run concurrently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench.common import median, percentile
from bench.workload import Session
from tokenization.block_hash import BlockHasher
from tokenization.chatml import render_segments
from tokenization.encoding import encode


@dataclass
class TurnResult:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    backend: str


@dataclass
class ReplayResult:
    turns: list[TurnResult] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # as sent, for the cache bound
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        ttfts = [t.ttft_s for t in self.turns]
        return {
            "requests": len(self.turns),
            "errors": len(self.errors),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "prefill_tokens": prompt - cached,
            "ttft_p50_ms": median(ttfts) * 1000,
            "ttft_p99_ms": percentile(ttfts, 99) * 1000,
            "wall_s": self.wall_s,
        }


async def _turn(
    http: aiohttp.ClientSession, url: str, session: Session, turn: int, model: str, sent: list[dict[str, Any]]
) -> TurnResult:
    body = session.request(turn, model)
    sent.append(body)
    start = time.perf_counter()
    ttft = None
    content: list[str] = []
    usage: dict[str, Any] = {}
    headers = {"content-type": "application/json", "x-session-id": session.key}
    async with http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
        backend = response.headers.get("x-prefixgate-backend", "")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices") or ():
                delta = choice.get("delta", {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    content.append(delta)
            if event.get("usage"):
                usage = event["usage"]
    latency = time.perf_counter() - start
    session.answer("".join(content))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return TurnResult(
        session.key, turn, usage.get("prompt_tokens", 0), cached, ttft or latency, latency, backend
    )


async def replay(url: str, sessions: Sequence[Session], model: str, time_scale: float = 1.0) -> ReplayResult:
    result = ReplayResult()
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def run(session: Session) -> None:
            for turn in range(len(session.user_turns)):
                if turn and session.think_time_s:
                    await asyncio.sleep(session.think_time_s * time_scale)
                try:
                    result.turns.append(await _turn(http, url, session, turn, model, result.requests))
                except Exception as exc:  # recorded, and the session stops: its history is now unknown
                    result.errors.append(f"{session.key} turn {turn}: {exc}")
                    return

        await asyncio.gather(*(run(s) for s in sessions))
    result.wall_s = time.perf_counter() - start
    return result


def infinite_cache_bound(requests: Sequence[dict[str, Any]], block_size: int) -> float:
    """Hit rate a single rank with an unlimited pool would reach on these requests, in this order."""
    hasher = BlockHasher(block_size)
    seen: set[bytes] = set()
    prompt_total = 0
    hit_total = 0
    for body in requests:
        tokens: list[int] = []
        for segment in render_segments(body["messages"], body.get("tools")):
            tokens.extend(encode(segment))
        hashes = hasher.hash_blocks(tokens)
        hittable = (len(tokens) - 1) // block_size
        hits = 0
        for h in hashes[:hittable]:
            if h not in seen:
                break
            hits += 1
        seen.update(hashes)
        prompt_total += len(tokens)
        hit_total += hits * block_size
    return hit_total / prompt_total if prompt_total else 0.0
