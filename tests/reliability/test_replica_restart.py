"""A prefixgate replica restarted while traffic flows, with Redis shared: every session keeps its rank.

Two replicas share one Redis; clients spread each session's turns over both (as a load balancer
would) and fail over to the other replica when one is gone. While the sessions run, one replica is
stopped and a fresh one started in its place: no turn of any session may move to another rank.
"""

from __future__ import annotations

import threading
import time

import httpx

from routing.policies.bounds import rendezvous_order
from routing.ranks import Rank
from tests.helpers.wait import wait_until
from tests.reliability.conftest import chat

SESSIONS = 4
TURNS = 8
RESTART_AFTER = 3  # turns every session has done before the restart


def sessions_split_between(names: list[str]) -> list[str]:
    """``SESSIONS`` session ids whose rendezvous favourites (the tie-break of idle ranks) split evenly
    between the two ranks ``names``: with requests too short to overlap, the first turns then still
    go to both ranks, so the last assertion checks stickiness rather than the timing of the turns."""
    ranks = [Rank(name, "http://127.0.0.1:1") for name in names]
    by_favourite: dict[str, list[str]] = {name: [] for name in names}
    for i in range(100):
        session = f"s-{i}"
        favourite = max(ranks, key=lambda r: rendezvous_order(session, r)).name
        by_favourite[favourite].append(session)
    half = SESSIONS // 2
    return [s for group in by_favourite.values() for s in group[:half]]


def test_sessions_keep_their_rank_across_a_replica_restart_under_traffic(rank_servers, gateway, redis_server):  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(2)
    backends = [(r.name, r.url) for r in ranks]
    # a loose load bound: this test is about the restart, not about spilling a busy rank's sessions
    options = {"policy": "prefix_affinity", "redis_url": redis_server.url, "balance_factor": 100.0}
    replicas = [gateway(backends, **options), gateway(backends, **options)]
    lock = threading.Lock()
    sessions = sessions_split_between([r.name for r in ranks])
    assert len(sessions) == SESSIONS
    used: dict[str, list[str]] = {s: [] for s in sessions}
    errors: list[str] = []
    restarted = threading.Event()

    def turn(session: str, n: int) -> str:
        body = chat(f"{session}: " + "shared repository context " * 60 + f" turn {n}", stream=n % 2 == 1)
        for attempt in range(2 * len(replicas)):
            with lock:
                url = replicas[(n + attempt) % len(replicas)].url
            try:
                answer = httpx.post(
                    url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=10
                )
            except httpx.TransportError:  # the replica is going or gone: the other one takes the turn
                time.sleep(0.05)
                continue
            assert answer.status_code == 200, answer.text
            return answer.headers["x-prefixgate-backend"]
        raise AssertionError(f"{session} turn {n}: no replica answered")

    def run(session: str) -> None:
        try:
            for n in range(TURNS):
                if n == RESTART_AFTER + 1:
                    restarted.wait(20)  # some turns land while the restart is under way
                used[session].append(turn(session, n))
        except BaseException as exc:  # reported below: a thread's failure must fail the test
            errors.append(f"{session}: {exc!r}")

    threads = [threading.Thread(target=run, args=(s,), daemon=True) for s in used]
    for thread in threads:
        thread.start()
    wait_until(
        lambda: min(len(v) for v in used.values()) >= RESTART_AFTER or errors,
        "sessions did not get going",
        timeout=20,
        interval=0.02,
    )
    replicas[0].stop()  # with turns in flight on both replicas
    fresh = gateway(backends, **options)
    with lock:
        replicas[0] = fresh
    restarted.set()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert all(len(v) == TURNS for v in used.values()), used
    for session, names in used.items():
        assert names == [names[0]] * TURNS, (session, names)
    # both ranks took sessions: stickiness, not everything on one rank
    assert {names[0] for names in used.values()} == {r.name for r in ranks}
