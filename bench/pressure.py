"""Memory pressure of a replay: the KV pools that make a trace's working set a given multiple of them.

A replay's working set at a moment is what ``bench.replay`` measures: the prompt tokens of every
active session's latest request. Its mean over the requests sent depends on the trace, the
concurrency and the think times, hardly on the system under test (the concurrency slots stay full),
so it can be estimated before any system runs: ``mean_working_set`` plays the replay's schedule
with instant answers (each session's requests ``think_time x time_scale`` apart, at most
``concurrency`` top-level sessions at once, sub-agents beside their parent). ``pool_for`` sizes
each rank's pool so that this mean is ``pressure`` x the fleet's pools. The table reports the
pressure the run really had, measured.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from bench.traces import TraceSession

#: The smallest pool ``pool_for`` gives a rank, in tokens.
MIN_POOL_TOKENS = 4096


def _timeline(
    session: TraceSession,
    start: float,
    time_scale: float,
    max_think_s: float,
    out: list[tuple[float, str, int]],
) -> float:
    """Append ``(time, session key, prompt tokens)`` for each request of ``session`` (and its
    sub-agents) starting at ``start``; returns when the session ends."""
    now = start
    for index, request in enumerate(session.requests):
        children = session.children.get(index)
        if children:
            now = max(_timeline(child, now, time_scale, max_think_s, out) for child in children)
        if index:
            now += min(request.think_time_s, max_think_s) * time_scale
        out.append((now, session.key, request.input_tokens))
    trailing = session.children.get(len(session.requests))
    if trailing:
        now = max(_timeline(child, now, time_scale, max_think_s, out) for child in trailing)
    return now


def mean_working_set(
    sessions: Sequence[TraceSession], concurrency: int, time_scale: float, max_think_s: float = 60.0
) -> float:
    """The replay's mean working set (tokens), answers taken as instant."""
    events: list[tuple[float, str, int]] = []
    ends: dict[str, float] = {}
    slots: list[float] = [0.0] * max(concurrency, 1)
    for session in sessions:
        free = heapq.heappop(slots)
        start = max(session.start_s * time_scale, free)
        first = len(events)
        end = _timeline(session, start, time_scale, max_think_s, events)
        for _, key, _ in events[first:]:
            ends[key] = max(ends.get(key, end), end)
        heapq.heappush(slots, end)
    events.sort(key=lambda e: e[0])
    active: dict[str, int] = {}
    expiring: list[tuple[float, str]] = []
    total = 0
    samples = 0
    for at, key, tokens in events:
        while expiring and expiring[0][0] < at:
            _, gone = heapq.heappop(expiring)
            total -= active.pop(gone, 0)
        if key not in active:
            heapq.heappush(expiring, (ends[key], key))
        total += tokens - active.get(key, 0)
        active[key] = tokens
        samples += total
    return samples / len(events) if events else 0.0


def pool_for(working_set: float, pressure: float, ranks: int, block_size: int = 16) -> int:
    """Each rank's pool (tokens, whole blocks) so that ``working_set`` is ``pressure`` x the fleet's."""
    tokens = working_set / (pressure * ranks)
    return max(MIN_POOL_TOKENS, math.ceil(tokens / block_size) * block_size)
