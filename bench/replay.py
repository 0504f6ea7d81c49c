"""Drive agent sessions against an OpenAI endpoint and measure what the ranks report.

Hit rate and prefill are computed from the ranks' own ``usage`` (``cached_tokens``), never from
prefixgate's estimates. Each session runs its turns in order (a turn waits for the previous answer);
sessions run concurrently.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from bench.chat_stream import Rejected, StreamOutcome, post_chat_stream, post_with_retries
from bench.common import median, percentile
from bench.sim import PromptProcessor
from bench.traces import BlockText, ChatBuilder, TraceRequest, TraceSession, UnitCacheBound
from bench.turn_figures import turn_figures
from tokenization.block_hash import BlockHasher


@dataclass
class TurnResult:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    latency_s: float
    #: The rank that answered (prefixgate's ``x-prefixgate-backend`` header; "" without prefixgate).
    rank: str
    #: Seconds from the start of the replay to sending the request.
    sent_s: float = 0.0
    #: The infinite-cache bound's hit tokens for this request (trace replays only).
    bound_hit_tokens: int = 0
    #: Tokens the rank generated (its ``usage.completion_tokens``).
    completion_tokens: int = 0
    #: Seconds from the client sending the request (its first attempt) to the rank receiving it: how
    #: long the system in front held it, 429 retries included; None when the rank does not tell.
    held_s: float | None = None
    #: Seconds from the rank receiving the request to scheduling it (a seat among its running
    #: sequences, and room in its pool); None when the rank does not tell.
    rank_queue_s: float | None = None

    def as_json(self) -> dict[str, Any]:
        """The turn as ``results.json`` keeps it (``backend``: the rank; ``session`` last)."""
        return {
            "turn": self.turn,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_s": self.ttft_s,
            "latency_s": self.latency_s,
            "backend": self.rank,
            "sent_s": self.sent_s,
            "bound_hit_tokens": self.bound_hit_tokens,
            "completion_tokens": self.completion_tokens,
            "held_s": self.held_s,
            "rank_queue_s": self.rank_queue_s,
            "session": self.session,
        }


@dataclass
class ReplayResult:
    turns: list[TurnResult] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # as sent, for the cache bound
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    #: Sessions (trace replays: conversations, sub-agents included) that ran every request without error.
    completed_sessions: int = 0
    #: Approximate KV working set (tokens the active sessions' latest prompts hold) at each request sent.
    working_set: list[int] = field(default_factory=list)
    #: 429/503 answers that a retry later got past.
    rejections: int = 0
    #: 429 answers, each one counted (retried or not).
    rate_limited: int = 0
    #: Requests answered 429 or 503 and not retried (each also in ``errors``; its session stopped).
    refused: int = 0

    def summary(self) -> dict[str, Any]:
        """Totals and percentiles over the answered requests, as the ranks reported them."""
        prompt = sum(t.prompt_tokens for t in self.turns)
        cached = sum(t.cached_tokens for t in self.turns)
        ttfts = [t.ttft_s for t in self.turns]
        latencies = [t.latency_s for t in self.turns]
        return {
            "requests": len(self.turns),
            "errors": len(self.errors),
            "rejections": self.rejections,
            "rate_limited": self.rate_limited,
            "refused": self.refused,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "prefill_tokens": prompt - cached,
            "ttft_p50_ms": median(ttfts) * 1000,
            "ttft_p99_ms": percentile(ttfts, 99) * 1000,
            "latency_p50_ms": median(latencies) * 1000,
            "latency_p99_ms": percentile(latencies, 99) * 1000,
            "latency_mean_ms": sum(latencies) / len(latencies) * 1000 if latencies else 0.0,
            "wall_s": self.wall_s,
            **turn_figures(self.turns, self.wall_s),
        }


def turn_result(
    session: str, turn: int, out: StreamOutcome, sent_s: float, bound_hit_tokens: int = 0
) -> TurnResult:
    """The record of one answered turn, from what its stream gave."""
    return TurnResult(
        session,
        turn,
        out.prompt_tokens,
        out.cached_tokens,
        out.ttft_s,
        out.latency_s,
        out.rank,
        sent_s,
        bound_hit_tokens,
        out.completion_tokens,
    )


class Conversation(Protocol):
    """What ``replay`` drives: a key, a number of turns, each turn's body, and the answers back."""

    @property
    def key(self) -> str: ...
    @property
    def turns(self) -> int: ...
    def request(self, turn: int, model: str) -> dict[str, Any]: ...
    def answer(self, content: str) -> None: ...


@dataclass(frozen=True)
class FixedBodies:
    """A conversation given as every turn's whole body (``bench.agent_shapes``: an agent's drift
    between requests fixed in advance), streamed with ``max_tokens``; the answers are not sent back."""

    key: str
    bodies: Sequence[dict[str, Any]]
    max_tokens: int = 8

    @property
    def turns(self) -> int:
        return len(self.bodies)

    def request(self, turn: int, model: str) -> dict[str, Any]:
        body = {**self.bodies[turn], "model": model, "stream": True, "max_tokens": self.max_tokens}
        body["stream_options"] = {"include_usage": True}
        return body

    def answer(self, content: str) -> None:
        """Nothing to keep: the next body is fixed already."""


async def replay(url: str, conversations: Sequence[Conversation], model: str) -> ReplayResult:
    """Run ``conversations`` concurrently against ``url``, each turn after the previous answer."""
    result = ReplayResult()
    start = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def run(conversation: Conversation) -> None:
            for turn in range(conversation.turns):
                sent_s = time.perf_counter() - start
                body = conversation.request(turn, model)
                result.requests.append(body)
                try:
                    out = await post_chat_stream(http, url, body, conversation.key)
                except Exception as exc:  # recorded, and the session stops: its history is now unknown
                    result.refused += isinstance(exc, Rejected)
                    result.errors.append(f"{conversation.key} turn {turn}: {exc}")
                    return
                conversation.answer(out.content)
                result.turns.append(turn_result(conversation.key, turn, out, sent_s))

        await asyncio.gather(*(run(c) for c in conversations))
    result.wall_s = time.perf_counter() - start
    return result


def infinite_cache_bound(requests: Sequence[dict[str, Any]], block_size: int) -> float:
    """Hit rate a single rank with an unlimited pool would reach on these requests, in this order."""
    prompts = PromptProcessor(BlockHasher(block_size))  # as a simulated rank tokenizes and hashes them
    seen: set[bytes] = set()
    prompt_total = 0
    hit_total = 0
    for body in requests:
        prompt = prompts.chat(body["messages"], body.get("tools"))
        tokens, hashes = prompt.token_ids, prompt.block_hashes
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


@dataclass
class TraceReplayConfig:
    """How a trace is replayed: ``concurrency`` conversations at a time, think times x ``time_scale``."""

    model: str
    concurrency: int = 8
    time_scale: float = 0.01
    #: Output tokens asked per request when ``max_output_tokens`` is None.
    max_tokens: int = 16
    #: When set, each request asks the trace's own output length (its ``out``), capped at this: the
    #: rank decodes what the agent's model did. The next request is still the trace's (its ids hold
    #: the answer as the trace recorded it), whatever text the rank generated.
    max_output_tokens: int | None = None
    #: Token length of one trace block (64 for Claude Code, 512 for Mooncake).
    block_tokens: int = 64
    #: KV block size of the ranks (for the infinite-cache bound).
    kv_block_size: int = 16
    seed: int = 0
    #: Think times longer than this (trace seconds: the user walked away) are cut to it before scaling.
    max_think_s: float = 60.0
    #: Attempts per request when the endpoint answers 429/503, and the longest wait between them (s).
    attempts: int = 20
    max_retry_wait_s: float = 1.0


async def replay_trace(
    url: str,
    sessions: Sequence[TraceSession],
    config: TraceReplayConfig,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> ReplayResult:
    """Replay trace sessions against ``url`` (OpenAI chat, streamed, ``x-session-id`` per session).

    At most ``config.concurrency`` top-level sessions run at once, each no earlier than its
    ``start_s`` x ``time_scale``; a session sends its requests in order, waiting for each answer
    and then the request's think time x ``time_scale``; sub-agents run as sessions of their own
    (concurrently with their siblings) before the parent's next request. A failed request is
    recorded and the session goes on (its next request is fixed by the trace, not by the answer).
    """
    result = ReplayResult()
    text = BlockText(config.block_tokens, config.seed)
    bound = UnitCacheBound(config.kv_block_size)
    active: dict[str, int] = {}  # session key -> prompt tokens of its latest request
    slots = asyncio.Semaphore(config.concurrency)
    start = time.perf_counter()

    async def run(http: aiohttp.ClientSession, session: TraceSession) -> bool:
        builder = ChatBuilder(session, text, config.block_tokens)
        ok = True
        try:
            for index, request in enumerate(session.requests):
                children = session.children.get(index)
                if children:
                    done = await asyncio.gather(*(run(http, child) for child in children))
                    ok = ok and all(done)
                if index and request.think_time_s and config.time_scale:
                    await asyncio.sleep(min(request.think_time_s, config.max_think_s) * config.time_scale)
                send = TraceSend(http, url, builder, session.key, index)
                ok = await send_trace_request(send, config, bound, active, result, start, on_turn) and ok
            trailing = session.children.get(len(session.requests), ())
            done = await asyncio.gather(*(run(http, child) for child in trailing))
            ok = ok and all(done)
        finally:
            active.pop(session.key, None)
        if ok:
            result.completed_sessions += 1
        return ok

    async def slot(http: aiohttp.ClientSession, session: TraceSession) -> None:
        delay = session.start_s * config.time_scale - (time.perf_counter() - start)
        if delay > 0:
            await asyncio.sleep(delay)
        async with slots:
            await run(http, session)

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        await asyncio.gather(*(slot(http, s) for s in sessions))
    result.wall_s = time.perf_counter() - start
    return result


@dataclass(frozen=True, slots=True)
class TraceSend:
    """Request ``index`` of the trace session ``key`` (built by its ``builder``), to ``url``."""

    http: aiohttp.ClientSession
    url: str
    builder: ChatBuilder
    key: str
    index: int


async def send_trace_request(
    send: TraceSend,
    config: TraceReplayConfig,
    bound: UnitCacheBound,
    active: dict[str, int],
    result: ReplayResult,
    start: float,
    on_turn: Callable[[TurnResult], None] | None,
) -> bool:
    """Build and send one request of a trace session (429/503 retried), recording its turn, the
    bound's hits and the working set, or its error (False; the trace fixes the next request
    regardless). ``active``: each active session's latest prompt tokens."""
    builder, key, index = send.builder, send.key, send.index
    body = builder.body(index, config.model, output_tokens(builder.session.requests[index], config))
    prompt, bound_hits = bound.add(builder.units())
    active[key] = prompt
    result.working_set.append(sum(active.values()))
    sent = time.perf_counter() - start
    sent_at = time.time()  # the clock a simulated rank reports its own times on (``sim_timing``)

    def count(rejected: Rejected) -> None:
        result.rate_limited += rejected.status == 429

    try:
        out, rejections = await post_with_retries(
            send.http, send.url, body, key, config.attempts, config.max_retry_wait_s, count
        )
    except Exception as exc:  # recorded
        result.errors.append(f"{key} request {index}: {exc}")
        return False
    result.rejections += rejections
    turn = turn_result(key, index, out, sent, bound_hits)
    if out.arrived_at is not None:
        turn.held_s = max(0.0, out.arrived_at - sent_at)
        if out.scheduled_at is not None:
            turn.rank_queue_s = max(0.0, out.scheduled_at - out.arrived_at)
    result.turns.append(turn)
    if on_turn is not None:
        on_turn(turn)
    return True


def output_tokens(request: TraceRequest, config: TraceReplayConfig) -> int:
    """``max_tokens`` of a trace request: its own output length capped at ``max_output_tokens``
    (at least 1: a rank answers at least one token), or the fixed ``max_tokens``."""
    if config.max_output_tokens is None:
        return config.max_tokens
    return max(1, min(request.output_tokens, config.max_output_tokens))


def bound_hit_rate(result: ReplayResult) -> float:
    """The infinite-cache bound of the requests a trace replay sent (see ``UnitCacheBound``)."""
    prompt = sum(t.prompt_tokens for t in result.turns)
    return sum(t.bound_hit_tokens for t in result.turns) / prompt if prompt else 0.0
