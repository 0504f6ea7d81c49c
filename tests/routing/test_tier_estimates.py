"""With a rank's KV offloading, prefixgate's estimate counts its CPU blocks, and says which part."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.helpers.gateway import start_gateway
from tests.helpers.ranks import RankServers


def ask(client: httpx.Client, url: str, session: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "prefixgate-sim", "messages": messages, "max_tokens": 4}
    answer = client.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
    assert answer.status_code == 200, answer.text
    return answer


def test_blocks_demoted_to_cpu_count_in_the_estimate_and_its_cpu_part(rank_servers: RankServers) -> None:
    # A takes 17 of the 27 usable blocks; B then needs 7 of A's, A's tail first
    (rank,) = rank_servers.sim(1, num_blocks=28, cpu_tier_tokens=4096, kv_events=True)
    # no admission: its seats would hold B back until A's session let its room go
    proxy = start_gateway([rank], kv_events="auto", no_admission=True)
    try:
        with httpx.Client(timeout=30) as client:
            a = [
                {"role": "system", "content": "You are agent A. " + "Keep to the rules. " * 40},
                {"role": "user", "content": "first task " * 20},
            ]
            first = ask(client, proxy.url, "a", a)
            assert first.headers["x-prefixgate-estimated-cpu-tokens"] == "0"
            a.append(first.json()["choices"][0]["message"])
            time.sleep(0.3)  # the rank's KV events reach prefixgate's mirror
            b = [
                {"role": "system", "content": "You are agent B. " + "Other rules here. " * 40},
                {"role": "user", "content": "second task " * 20},
            ]
            ask(client, proxy.url, "b", b)  # needs A's free blocks: their tail goes to the CPU tier
            time.sleep(0.3)
            state = client.get(rank.url + "/sim/state").json()
            assert state["cpu_tier"]["cached_blocks"] > 0, "the pool was small enough to offload"
            loaded_before = state["counters"]["cpu_tier_hits"]
            # the admin view: the index's tokens by tier (A's tail in CPU memory only)
            (view,) = client.get(proxy.url + "/admin/overview").json()["ranks"]
            assert view["index_tokens"]["cpu"] == state["cpu_tier"]["cached_blocks"] * 16
            assert view["index_tokens"]["gpu"] == state["cached_blocks"] * 16

            a.append({"role": "user", "content": "next step"})
            again = ask(client, proxy.url, "a", a)
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            loaded = client.get(rank.url + "/sim/state").json()["counters"]["cpu_tier_hits"] - loaded_before
            assert loaded > 0 and cached > loaded, "part GPU hit, part loaded from the CPU tier"
            assert int(again.headers["x-prefixgate-estimated-cached-tokens"]) == cached
            assert int(again.headers["x-prefixgate-estimated-cpu-tokens"]) == loaded
    finally:
        proxy.stop()
