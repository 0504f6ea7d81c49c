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


def in_step(client: httpx.Client, proxy_url: str, ranks: list[Any], deadline_s: float = 10.0) -> None:
    """Wait until prefixgate's index holds, by tier, what every rank holds (its KV events applied):
    the blocks a rank caches on its GPU, and those only its CPU tier holds (nothing in flight: the
    ranks' state is read in place)."""
    deadline = time.monotonic() + deadline_s
    while True:
        overview = client.get(proxy_url + "/admin/overview").json()
        views = {v["name"]: v["index_tokens"] for v in overview["ranks"]}
        truth = {}
        for rank in ranks:
            gpu = {h for h, copies in rank.rank.pool.cached.items() if copies}
            cpu_only = [h for h in rank.rank.engine.cpu_tier.blocks if h not in gpu]
            truth[rank.name] = {"gpu": len(gpu) * 16, "cpu": len(cpu_only) * 16}
        if views == truth:
            return
        assert time.monotonic() < deadline, f"the index never caught up: {views} against {truth}"
        time.sleep(0.02)


def test_every_turn_of_several_sessions_on_two_ranks_is_estimated_as_reported_by_tier(
    rank_servers: RankServers,
) -> None:
    # small pools (27 usable blocks each) and CPU tiers of 256 blocks: the sessions' turns evict
    # each other's blocks to the tiers and load them back
    ranks = rank_servers.sim(2, num_blocks=28, cpu_tier_tokens=4096, kv_events=True)
    by_name = {r.name: r for r in ranks}
    proxy = start_gateway(ranks, kv_events="auto", no_admission=True)
    conversations = {
        name: [
            {"role": "system", "content": f"You are agent {name}. " + f"Rules of {name}. " * 40},
            {"role": "user", "content": f"task of {name} " * 20},
        ]
        for name in ("a", "b", "c", "d")
    }
    turns = loaded_turns = gpu_turns = 0
    try:
        with httpx.Client(timeout=30) as client:
            for turn in range(3):
                for name, messages in conversations.items():
                    in_step(client, proxy.url, ranks)
                    loaded = {r.name: r.rank.counters.cpu_tier_hits for r in ranks}
                    answer = ask(client, proxy.url, name, messages)
                    rank = by_name[answer.headers["x-prefixgate-backend"]]
                    cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                    from_cpu = rank.rank.counters.cpu_tier_hits - loaded[rank.name]
                    where = f"session {name} turn {turn} on {rank.name}"
                    assert int(answer.headers["x-prefixgate-estimated-cached-tokens"]) == cached, where
                    assert int(answer.headers["x-prefixgate-estimated-cpu-tokens"]) == from_cpu, where
                    turns += 1
                    loaded_turns += from_cpu > 0
                    gpu_turns += cached > from_cpu
                    messages.append(answer.json()["choices"][0]["message"])
                    messages.append({"role": "user", "content": f"step {turn} of {name}"})
    finally:
        proxy.stop()
    assert turns == 12
    # both tiers were hit: the pools were small enough to offload, and turns loaded from the tiers
    assert loaded_turns >= 2 and gpu_turns >= 2
