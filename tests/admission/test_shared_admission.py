"""Admission shared by replicas through Redis: three replica processes admitting new sessions at once
keep each rank's admitted working set, as the ranks report it, within its budget.

On main (claims per process) the same run put three sessions on a rank in 4 runs of 4: the
window between one replica's room check and its session's rank reaching the shared table is a few
Redis round trips wide. ``test_shared_claims.py`` opens that window deterministically."""

from __future__ import annotations

import contextlib
import threading

import httpx

from proxy.config import DEFAULT_TARGET_FRACTION
from tests.admission.conftest import KV_TOKENS, chat
from tests.helpers.gateway import proxy_process
from tests.helpers.ranks import RankServers
from tests.helpers.redis_server import RedisServer

BUDGET = int(KV_TOKENS * DEFAULT_TARGET_FRACTION)
SESSION_TOKENS = 700  # two fit a rank's budget, a third does not


#: Seconds a client waits for its answer: those without a seat are still waiting for one then (no
#: seat rotates within the test's rotation bound).
PATIENCE = 4.0


def admit_at_once(
    urls: list[str], sessions: int, tokens: int = SESSION_TOKENS
) -> list[httpx.Response | None]:
    """The first request of ``sessions`` new sessions of ``tokens``, all sent at once, dealt across
    ``urls``; None for a request still waiting for a seat when its client gave up."""
    answers: dict[int, httpx.Response | None] = {}
    start = threading.Barrier(sessions)

    def send(i: int) -> None:
        start.wait(10)
        try:
            answers[i] = chat(urls[i % len(urls)], f"race-{i}", tokens, timeout=PATIENCE)
        except httpx.TimeoutException:
            answers[i] = None

    threads = [threading.Thread(target=send, args=(i,)) for i in range(sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return [answers[i] for i in range(sessions)]


def test_replicas_admitting_at_once_keep_each_rank_within_its_budget(
    rank_servers: RankServers, redis_server: RedisServer
) -> None:
    replicas_keep_each_rank_within_its_budget(rank_servers, redis_server.url)


def replicas_keep_each_rank_within_its_budget(rank_servers: RankServers, redis_url: str) -> None:
    """Three replica processes on ``redis_url`` admit 24 new sessions at once over two ranks with
    room for two each: what each rank holds, as it reports it, stays within its budget."""
    ranks = rank_servers.sim(2)
    flags = ["--redis-url", redis_url, "--admission-wait", "600"]
    flags += ["--session-idle-ttl", "120", "--health-interval", "0.5"]
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(3):  # one process each, as replicas are: they admit truly at once
            replica, url = proxy_process([f"{r.name}={r.url}" for r in ranks], extra=flags)
            stack.enter_context(replica)
            urls.append(url)
        answers = admit_at_once(urls, 24)
        for url in urls:
            assert "prefixgate_admission_shared_up 1.0" in httpx.get(url + "/metrics").text
    assert {a.status_code for a in answers if a is not None} == {200}
    assert None in answers  # the rest were still waiting for a seat
    # what each rank holds, in its own figures: the prompt and the answer of every session it served
    held: dict[str, list[int]] = {r.name: [] for r in ranks}
    for answer in answers:
        if answer is not None:
            usage = answer.json()["usage"]
            held[answer.headers["x-prefixgate-backend"]].append(
                usage["prompt_tokens"] + usage["completion_tokens"]
            )
    for name, sizes in held.items():
        assert sizes, f"rank {name} admitted nobody"
        # the issue allows one session past the budget; the shared claims keep within it
        assert sum(sizes) <= BUDGET, f"rank {name} holds {sizes} past its budget of {BUDGET}"


CAP = 2  # --max-sessions-per-rank: what binds here, the budget has room for many more


def test_replicas_admitting_at_once_keep_each_rank_within_its_session_cap(
    rank_servers: RankServers, redis_server: RedisServer
) -> None:
    replicas_keep_each_rank_within_its_session_cap(rank_servers, redis_server.url)


def replicas_keep_each_rank_within_its_session_cap(rank_servers: RankServers, redis_url: str) -> None:
    """Three replica processes on ``redis_url`` admit 24 small new sessions at once over two ranks
    that hold two sessions each (``--max-sessions-per-rank 2``): no rank serves more than two."""
    ranks = rank_servers.sim(2)
    flags = ["--redis-url", redis_url, "--admission-wait", "600"]
    flags += ["--session-idle-ttl", "120", "--health-interval", "0.5", "--max-sessions-per-rank", str(CAP)]
    with contextlib.ExitStack() as stack:
        urls = []
        for _ in range(3):
            replica, url = proxy_process([f"{r.name}={r.url}" for r in ranks], extra=flags)
            stack.enter_context(replica)
            urls.append(url)
        answers = admit_at_once(urls, 24, tokens=60)
    assert {a.status_code for a in answers if a is not None} == {200}
    assert None in answers  # the rest were still waiting for a seat
    sessions: dict[str, int] = {r.name: 0 for r in ranks}
    for answer in answers:
        if answer is not None:
            sessions[answer.headers["x-prefixgate-backend"]] += 1
    assert sessions == {r.name: CAP for r in ranks}, f"sessions served per rank: {sessions}"
