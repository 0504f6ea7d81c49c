"""The load benchmarks' client side: agent-shaped streaming sessions, large first turns arriving
beside them, a phase's figures, and a prefixgate config in front of stub ranks.

Used by ``bench/load.py`` (closed loop: each session sends its next turn as soon as the last one
ends, which saturates the proxy) and ``bench/paced_load.py`` (each session thinks between turns, so
the load stays at a chosen rate below saturation).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from bench.common import EMBEDDED_TOKENIZER_YAML, median, percentile
from bench.side_by_side import growing_conversation

#: Latencies of the first seconds of a phase are left out (connections opening, caches cold).
WARMUP_S = 5.0
SYSTEM = "You are a careful coding agent working in a large repository. " * 20
DONE = b"data: [DONE]"


@dataclass
class PhaseStats:
    started: float
    latencies: list[float] = field(default_factory=list)
    completed: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    #: Seconds each large first turn took (``--first-turn-tokens``).
    first_turns: list[float] = field(default_factory=list)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


async def session(
    http: aiohttp.ClientSession, url: str, sid: int, stats: PhaseStats, stop_at: float, think_s: float = 0.0
) -> None:
    """One session's growing conversation until ``stop_at``: each turn streamed to the end, then (with
    ``think_s``) a pause drawn from an exponential distribution of that mean before the next."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    turn = 0
    rng = random.Random(sid)
    await asyncio.sleep(rng.random() * 2.0)  # spread the first requests over 2 s
    while time.monotonic() < stop_at:
        turn += 1
        messages.append({"role": "user", "content": f"session {sid} turn {turn}: fix the next failing test"})
        if len(messages) > 12:  # keep bodies agent-sized but bounded
            del messages[1:3]
        body = orjson.dumps({"model": "stub-model", "messages": messages, "stream": True, "max_tokens": 8})
        sent = time.monotonic()
        try:
            async with http.post(
                url + "/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json", "x-session-id": f"load-{sid}"},
            ) as response:
                data = await response.read()
                if response.status != 200:
                    stats.error(f"http_{response.status}")
                elif not data.rstrip().endswith(DONE) or b'"error"' in data:
                    stats.error("stream_incomplete")
                else:
                    stats.completed += 1
                    if sent - stats.started >= WARMUP_S:
                        stats.latencies.append(time.monotonic() - sent)
        except (aiohttp.ClientError, TimeoutError) as exc:
            stats.error(type(exc).__name__)
        messages.append({"role": "assistant", "content": "Done; the test passes now."})
        if think_s:
            await asyncio.sleep(min(rng.expovariate(1.0 / think_s), max(stop_at - time.monotonic(), 0.0)))


async def first_turns(
    http: aiohttp.ClientSession, urls: list[str], tokens: int, every: float, stats: PhaseStats, stop_at: float
) -> None:
    """A new session's ~``tokens``-token first turn every ``every`` seconds (streamed to the end),
    over ``urls`` in turn: the tokenization that must not hold up everybody else's requests."""
    n = 0
    while time.monotonic() + every < stop_at:
        await asyncio.sleep(every)
        body = growing_conversation(tokens, 500, 1, seed=10_000 + n, stream=True)[0]
        headers = {"content-type": "application/json", "x-session-id": f"first-turn-{n}"}
        sent = time.monotonic()
        try:
            async with http.post(
                urls[n % len(urls)] + "/v1/chat/completions", data=body, headers=headers
            ) as r:
                data = await r.read()
                if r.status != 200 or not data.rstrip().endswith(DONE):
                    stats.error(f"first_turn_http_{r.status}")
                else:
                    stats.first_turns.append(time.monotonic() - sent)
        except (aiohttp.ClientError, TimeoutError) as exc:
            stats.error(f"first_turn_{type(exc).__name__}")
        n += 1


async def run_phase(
    urls: list[str],
    sessions: int,
    seconds: float,
    first_turn_tokens: int = 0,
    first_turn_every: float = 2.0,
    think_s: float = 0.0,
) -> PhaseStats:
    stats = PhaseStats(started=time.monotonic())
    stop_at = stats.started + seconds
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        tasks = [session(http, urls[i % len(urls)], i, stats, stop_at, think_s) for i in range(sessions)]
        if first_turn_tokens:
            tasks.append(first_turns(http, urls, first_turn_tokens, first_turn_every, stats, stop_at))
        await asyncio.gather(*tasks)
    return stats


def summarize(stats: PhaseStats, seconds: float) -> dict[str, Any]:
    lat = stats.latencies
    out = {
        "seconds": seconds,
        "completed": stats.completed,
        "requests_per_s": round(stats.completed / seconds, 1),
        "errors": stats.errors,
        "error_kinds": stats.error_kinds,
        "p50_ms": round(median(lat) * 1000, 2),
        "p99_ms": round(percentile(lat, 99) * 1000, 2),
    }
    if stats.first_turns:
        out["first_turns"] = len(stats.first_turns)
        out["first_turn_p50_ms"] = round(median(stats.first_turns) * 1000, 1)
    return out


def proxy_config(rank_urls: list[str], yaml_path: str | None, pool_tokens: int | None) -> Path:
    """A temporary prefixgate config: the embedded tokenizer, ``yaml_path``'s settings, the stub ranks."""
    settings: dict[str, Any] = yaml.safe_load(EMBEDDED_TOKENIZER_YAML)
    if yaml_path:
        settings.update(yaml.safe_load(Path(yaml_path).read_text()) or {})
    settings["backends"] = [
        {"name": f"stub-{i}", "url": url, **({"pool_tokens": pool_tokens} if pool_tokens else {})}
        for i, url in enumerate(rank_urls)
    ]
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="load-proxy-", delete=False) as f:
        yaml.safe_dump(settings, f)
    return Path(f.name)
