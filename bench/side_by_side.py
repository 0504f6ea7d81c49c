"""Time the same requests straight to a rank and through several proxies, interleaved.

Each sample sends one request to every system in turn (straight to the rank first, then each
proxy) so all of them see the same machine noise. The proxies' order goes through every
permutation, one per sample, so each proxy follows every other equally often: a system is slower
right after one that kept the machine busy or idle for long (sglang-router's streams take ~42 ms
to their first byte), and a plain rotation put one proxy after the same neighbour in two samples
of three. A system's *added* latency is the median over samples of its time minus the rank's time
for the same sample. Systems are prefixgate from this tree, optionally prefixgate from another
source tree (``--baseline-root``: e.g. a worktree of main, the "before" of a change) and the peer
routers of ``bench/peers``. ``growing_conversation`` builds the shape agents send most: a long
conversation growing by about a thousand tokens a turn.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import median, percentile, proxy_process

PATH = "/v1/chat/completions"
_CODE = "def function_{i}(x):\n    return x * {i} + helper(x - {i})\n"


@dataclass(frozen=True, slots=True)
class System:
    name: str
    url: str
    #: The process serving ``url`` (for its CPU time), when known.
    pid: int | None = None


@contextlib.contextmanager
def proxies(
    rank_url: str, proxy_args: list[str], baseline_root: Path | None, peers: bool
) -> Iterator[list[System]]:
    """prefixgate (this tree), optionally prefixgate from ``baseline_root`` and sglang-router
    cache_aware, each in its own process in front of ``rank_url``."""
    with contextlib.ExitStack() as stack:
        proc, url = proxy_process([rank_url], extra=proxy_args)
        systems = [System("prefixgate", url, stack.enter_context(proc).pid)]
        if baseline_root is not None:
            proc, url = proxy_process([rank_url], extra=proxy_args, root=baseline_root)
            systems.append(System(f"prefixgate@{baseline_root.name}", url, stack.enter_context(proc).pid))
        if peers:
            from bench.peers import PEERS, PeerRouter

            spec = next(p for p in PEERS if p.name == "sglang cache_aware")
            router = stack.enter_context(PeerRouter(spec, [rank_url]))
            systems.append(System(spec.name, router.url, router.pid))
        yield systems


def time_request(client: httpx.Client, url: str, body: bytes, stream: bool, session: str | None) -> float:
    """Seconds until the full response (non-streaming) or its first byte (streaming)."""
    headers = {"content-type": "application/json"}
    if session is not None:
        headers["x-session-id"] = session
    start = time.perf_counter()
    if not stream:
        response = client.post(url, content=body, headers=headers)
        elapsed = time.perf_counter() - start
        response.raise_for_status()
        return elapsed
    with client.stream("POST", url, content=body, headers=headers) as response:
        response.raise_for_status()
        elapsed = 0.0
        for _ in response.iter_raw():
            if not elapsed:
                elapsed = time.perf_counter() - start
    return elapsed


def interleaved(
    direct: str,
    systems: list[System],
    bodies: list[bytes],
    stream: bool,
    conversations: list[str] | None = None,
) -> dict[str, dict[str, float]]:
    """Send each body to the rank and to every system (in every order in turn); per system its p50
    and p99 and its added p50 (and p99) over the rank's time. ``conversations``: the conversation
    of each body, sent as ``x-session-id`` (one session per system and conversation)."""
    times: dict[str, list[float]] = {"direct": [], **{s.name: [] for s in systems}}
    orders = list(itertools.permutations(systems))
    with httpx.Client(timeout=60) as client:
        for k, body in enumerate(bodies):
            times["direct"].append(time_request(client, direct + PATH, body, stream, None))
            for system in orders[k % len(orders)]:
                session = f"{system.name}-{conversations[k]}" if conversations else None
                times[system.name].append(time_request(client, system.url + PATH, body, stream, session))
    ms = 1000.0
    out: dict[str, dict[str, float]] = {
        "direct": {"p50_ms": median(times["direct"]) * ms, "p99_ms": percentile(times["direct"], 99) * ms}
    }
    for system in systems:
        mine, base = times[system.name], times["direct"]
        out[system.name] = {
            "p50_ms": median(mine) * ms,
            "p99_ms": percentile(mine, 99) * ms,
            "added_p50_ms": median([a - b for a, b in zip(mine, base, strict=True)]) * ms,
            "added_p99_ms": (percentile(mine, 99) - percentile(base, 99)) * ms,
        }
    return out


def growing_conversation(
    start_tokens: int,
    step_tokens: int,
    turns: int,
    seed: int,
    stream: bool = False,
    reminder: str | None = None,
) -> list[bytes]:
    """The bodies of one conversation of about ``start_tokens`` tokens (~4 characters each) that
    grows by about ``step_tokens`` a turn: each turn adds the assistant's answer and a user message
    carrying new code, as an agent's tool results do. ``reminder``: the newest user message ends
    with it, and the next turn drops it from there (an edit near the end of a message already sent,
    as agents make to their last message)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent working in a large repository. " * 40}
    ]
    n = 0

    def user(tokens: int) -> dict[str, Any]:
        nonlocal n
        lines: list[str] = []
        while sum(len(line) for line in lines) < tokens * 4:
            lines.append(_CODE.format(i=f"{seed}_{n}"))
            n += 1
        return {"role": "user", "content": "".join(lines)}

    while sum(len(m["content"]) for m in messages) < start_tokens * 4:
        messages.append(user(2000))
        messages.append({"role": "assistant", "content": f"Read them; step {n} next. " * 20})
    bodies = []
    for turn in range(turns):
        if reminder is not None and turn:
            sent = messages[-2]
            messages[-2] = {**sent, "content": sent["content"].removesuffix(reminder)}
        messages.append(user(step_tokens))
        if reminder is not None:
            messages[-1]["content"] += reminder
        body = {"model": "stub-model", "messages": messages, "max_tokens": 16, "stream": stream}
        bodies.append(orjson.dumps(body))
        messages.append({"role": "assistant", "content": f"Done with turn {turn}; running the tests."})
    return bodies
