"""One streamed chat turn as an agent's client sends it, and its retries.

``post_chat_stream`` POSTs a chat body with the session's ``x-session-id`` and reads the stream to its
end: TTFT is the first content delta, the rank's ``usage`` (cached tokens among it) comes from the
stream's tail, the answering rank from prefixgate's ``x-prefixgate-backend``. ``post_with_retries``
retries what the openai SDK retries (429/502/503/504, and a connection that failed before any answer),
honouring ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass(slots=True)
class StreamOutcome:
    """What one streamed chat completion gave: the rank's usage and the client-side timings."""

    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    #: The rank that answered (``x-prefixgate-backend``).
    rank: str
    content: str
    #: Tokens generated (``usage.completion_tokens``).
    completion_tokens: int = 0
    #: When the rank received the request and first scheduled it (``time.time()``), from the
    #: ``sim_timing`` a simulated rank started with ``--report-timing`` sends with its usage.
    arrived_at: float | None = None
    scheduled_at: float | None = None


async def post_chat_stream(
    http: aiohttp.ClientSession, url: str, body: dict[str, Any], session_key: str
) -> StreamOutcome:
    """POST a streaming chat body; TTFT is the first content delta, usage comes from the stream's tail."""
    start = time.perf_counter()
    ttft = None
    content: list[str] = []
    usage: dict[str, Any] = {}
    timing: dict[str, float] = {}
    headers = {"content-type": "application/json", "x-session-id": session_key}
    try:
        response = await http.post(url + "/v1/chat/completions", data=orjson.dumps(body), headers=headers)
    except aiohttp.ClientConnectionError as exc:  # no answer began: retried, as the openai SDK does
        raise Rejected(0, CONNECTION_RETRY_S, repr(exc).encode()) from exc
    async with response:
        if response.status in RETRIED_STATUSES:
            retry_after = float(response.headers.get("retry-after") or 1)
            raise Rejected(response.status, retry_after, await response.read())
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.read())[:200]!r}")
        rank = response.headers.get("x-prefixgate-backend", "")
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"stream error: {event['error']}")
            for choice in event.get("choices") or ():
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    content.append(delta)
            if event.get("usage"):
                usage = event["usage"]
            if event.get("sim_timing"):
                timing = event["sim_timing"]
    latency = time.perf_counter() - start
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return StreamOutcome(
        usage.get("prompt_tokens", 0),
        cached,
        ttft or latency,
        latency,
        rank,
        "".join(content),
        usage.get("completion_tokens") or 0,
        timing.get("arrived_at"),
        timing.get("scheduled_at"),
    )


#: Answers a client retries (the openai SDK's rule: rate limits and gateway failures), and how long it
#: waits after a connection that failed before any answer.
RETRIED_STATUSES = (429, 502, 503, 504)
CONNECTION_RETRY_S = 0.5


class Rejected(RuntimeError):
    """The endpoint answered 429/502/503/504, or the connection failed before any answer: come back
    after ``retry_after_s``."""

    def __init__(self, status: int, retry_after_s: float, detail: bytes) -> None:
        super().__init__(f"HTTP {status}: {detail[:200]!r}")
        self.status = status
        self.retry_after_s = retry_after_s


async def post_with_retries(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    session_key: str,
    attempts: int,
    max_wait_s: float,
    on_rejected: Callable[[Rejected], None] | None = None,
) -> tuple[StreamOutcome, int]:
    """``post_chat_stream``, retried on 429/502/503/504 and on a connection that failed before any
    answer, like agents do (honouring ``Retry-After``, capped at ``max_wait_s``); TTFT and latency
    count from the first attempt. Returns the outcome and the number of rejections before it;
    ``on_rejected`` hears of each rejection (the last one too, when no attempt is left)."""
    start = time.perf_counter()
    for attempt in range(attempts):
        try:
            out = await post_chat_stream(http, url, body, session_key)
        except Rejected as exc:
            if on_rejected is not None:
                on_rejected(exc)
            if attempt + 1 == attempts:
                raise
            await asyncio.sleep(min(exc.retry_after_s, max_wait_s))
            continue
        waited = out.latency_s - (time.perf_counter() - start)  # negative: time spent before this attempt
        out.ttft_s -= waited
        out.latency_s -= waited
        return out, attempt
    raise AssertionError("unreachable")
