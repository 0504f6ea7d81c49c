"""prefixgate with its defaults in front of simulated ranks: sticky sessions, exact predictions."""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

import httpx
import pytest

from bench.sim import SimRankServer
from tests.helpers.gateway import start_gateway
from tests.helpers.ranks import RankServers

SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 20


@pytest.fixture
def fleet(rank_servers: RankServers) -> list[SimRankServer]:
    return rank_servers.sim(3, kv_tokens=200_000, kv_events=True)


def converse(url: str, session: str, system: Any, turns: int, think_s: float = 0.0) -> list[httpx.Response]:
    messages: list[dict[str, Any]] = []
    answers = []
    with httpx.Client(timeout=30) as client:
        for turn in range(turns):
            head = system(turn) if callable(system) else system
            user = f"step {turn}: " + "edit the file and run the tests. " * 30
            messages.append({"role": "user", "content": user})
            body = {"model": "prefixgate-sim", "messages": [{"role": "system", "content": head}, *messages]}
            response = client.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
            assert response.status_code == 200, response.text
            answers.append(response)
            time.sleep(think_s)
            messages.append(
                {"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]}
            )
    return answers


def cached(response: httpx.Response) -> int:
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("kv_events", [None, "auto"])
def test_sessions_stick_and_predictions_match_reports(fleet, kv_events):
    proxy = start_gateway(fleet, kv_events=kv_events)
    try:
        for session in ("alpha", "beta", "gamma"):
            # KV events reach prefixgate's subscriber thread a few milliseconds after the answer;
            # an agent thinks for seconds between turns, so give the mirror that moment.
            answers = converse(proxy.url, session, SYSTEM, 4, think_s=0.2 if kv_events else 0.0)
            assert len({a.headers["x-prefixgate-backend"] for a in answers}) == 1
            assert all(a.headers["x-prefixgate-session"] == session for a in answers)
            for answer in answers[1:]:
                estimate = int(answer.headers["x-prefixgate-estimated-cached-tokens"])
                assert cached(answer) > 0
                if kv_events:  # the rank's own events: exact
                    assert estimate == cached(answer)
                else:
                    # From routing history alone prefixgate cannot see the blocks the rank cached
                    # while decoding the previous answer (16 tokens: at most 2 blocks of 16).
                    assert 0 <= cached(answer) - estimate <= 32
    finally:
        proxy.stop()


def test_canonicalization_turns_a_drifting_prompt_into_hits(fleet):
    def drifting(turn: int) -> str:
        return f"{SYSTEM}\nThe current date is 2026-11-30 10:{turn:02d}:17."

    on = start_gateway(fleet)
    try:
        with_canon = converse(on.url, "drift-on", drifting, 3)
    finally:
        on.stop()
    off = start_gateway(fleet, no_canonicalize=True)
    try:
        without = converse(off.url, "drift-off", lambda t: drifting(t).replace("drift", "x"), 3)
    finally:
        off.stop()
    # Without canonicalization every turn breaks inside the system prompt: only what precedes the
    # timestamp can hit. With it, the whole previous turn hits.
    assert sum(cached(a) for a in with_canon[1:]) > 2 * sum(cached(a) for a in without[1:])
    for previous, answer in pairwise(with_canon):
        assert cached(answer) >= previous.json()["usage"]["prompt_tokens"] - 16


def test_kv_events_are_exact_whatever_the_ranks_hash_algorithm(rank_servers: RankServers) -> None:
    # The ranks hash with sha256_cbor and prefixgate with its default (xxh3): the mirror re-keys each
    # stored block from its token ids, so the estimates still equal what the ranks report.
    ranks = rank_servers.sim(2, kv_tokens=200_000, kv_events=True, hash_algo="sha256_cbor")
    proxy = start_gateway(ranks, kv_events="auto")
    try:
        answers = converse(proxy.url, "cbor", SYSTEM, 3, think_s=0.2)
        for answer in answers[1:]:
            assert cached(answer) > 0
            assert int(answer.headers["x-prefixgate-estimated-cached-tokens"]) == cached(answer)
    finally:
        proxy.stop()
