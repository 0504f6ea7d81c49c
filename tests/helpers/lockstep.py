"""A trace replayed one request at a time, in an order fixed by the trace alone.

``bench.replay.replay_trace`` runs sessions concurrently: which request reaches the proxy first
depends on how long the others took, so two runs of the same system differ (1-replica rounds of a
trace replay spread 6-12 points of hit rate), and a comparison of 1 against N replicas cannot resolve
the 0.01 the replicas are asked to match. Here the requests go one after another, in
the order the trace's own clock gives them when answers take no time: each top-level session starts
at its ``start_s`` (or when one of the ``concurrency`` slots frees), each request comes its think
time after the previous one, sub-agents run (interleaved with their siblings) before the parent's
next request. The sessions still interleave, so the pools are as full as in the concurrent replay;
but the ranks, the index and admission see the same sequence in every run, and only what the system
itself does differently (one replica, or N sharing state) can change what they hold.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence

import aiohttp

from bench.replay import ReplayResult, TraceReplayConfig, TraceSend, TurnResult, send_trace_request
from bench.traces import BlockText, ChatBuilder, TraceSession, UnitCacheBound

#: One request of the order: (virtual seconds, generation rank, its session, its index).
Step = tuple[float, int, TraceSession, int]


def _steps(
    session: TraceSession, start: float, max_think_s: float, ranks: Iterator[int]
) -> tuple[list[Step], float]:
    """``session``'s requests (its sub-agents' before the request that waits for them) from virtual
    time ``start``, and when its last one is sent."""
    steps: list[Step] = []
    now = start
    for index, request in enumerate(session.requests):
        children = session.children.get(index, ())
        ends = [now]
        for child in children:  # siblings run side by side, from the same moment
            child_steps, end = _steps(child, now, max_think_s, ranks)
            steps += child_steps
            ends.append(end)
        now = max(ends)
        if index and request.think_time_s:
            now += min(request.think_time_s, max_think_s)
        steps.append((now, next(ranks), session, index))
    for child in session.children.get(len(session.requests), ()):
        child_steps, end = _steps(child, now, max_think_s, ranks)
        steps += child_steps
        now = max(now, end)
    return steps, now


def lockstep_order(sessions: Sequence[TraceSession], concurrency: int, max_think_s: float) -> list[Step]:
    """Every request of ``sessions`` (sub-agents included) in the order they would be sent if
    answers took no time, at most ``concurrency`` top-level sessions at once; ties go in the order
    the requests were generated (a session's own requests keep theirs)."""
    ranks = itertools.count()
    running: list[float] = []  # when each running top-level session sends its last request
    steps: list[Step] = []
    for session in sorted(sessions, key=lambda s: s.start_s):
        start = session.start_s
        if len(running) >= concurrency:
            start = max(start, heapq.heappop(running))
        session_steps, end = _steps(session, start, max_think_s, ranks)
        steps += session_steps
        heapq.heappush(running, end)
    return sorted(steps, key=lambda step: (step[0], step[1]))


async def replay_lockstep(
    url: str,
    sessions: Sequence[TraceSession],
    config: TraceReplayConfig,
    on_turn: Callable[[TurnResult], None] | None = None,
) -> ReplayResult:
    """Replay ``sessions`` against ``url`` one request at a time in ``lockstep_order`` (streamed,
    ``x-session-id`` per session, 429/503 retried as ``replay_trace`` does); no think time is slept."""
    result = ReplayResult()
    text = BlockText(config.block_tokens, config.seed)
    bound = UnitCacheBound(config.kv_block_size)
    order = lockstep_order(sessions, config.concurrency, config.max_think_s)
    last = {id(session): index for _, _, session, index in order}  # each session's last request
    builders: dict[int, ChatBuilder] = {}
    failed: set[int] = set()
    active: dict[str, int] = {}
    start = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as http:
        for _, _, session, index in order:
            builder = builders.get(id(session))
            if builder is None:
                builder = builders[id(session)] = ChatBuilder(session, text, config.block_tokens)
            send = TraceSend(http, url, builder, session.key, index)
            if not await send_trace_request(send, config, bound, active, result, start, on_turn):
                failed.add(id(session))
            if index == last[id(session)]:
                active.pop(session.key, None)
                result.completed_sessions += id(session) not in failed
    result.wall_s = time.perf_counter() - start
    return result
