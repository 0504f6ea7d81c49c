"""On a rank that offloads KV to CPU memory, the seat budget covers the GPU pool and the CPU tier,
whose size prefixgate learns from the rank's KV events when the tier first evicts."""

from __future__ import annotations

from typing import Any

import httpx

from tests.admission.conftest import KV_TOKENS, Background, chat, metric
from tests.admission.test_release import FRACTION
from tests.helpers.wait import wait_until

BLOCK = 16
#: A CPU tier of a quarter of the pool: four 700-token sessions fill the pool and the tier.
CPU_TIER_TOKENS = 32 * BLOCK


def rank_view(url: str) -> dict[str, Any]:
    (view,) = httpx.get(url + "/admin/overview", timeout=5).json()["ranks"]
    return view


def learned_tier(url: str) -> int | None:
    (backend,) = httpx.get(url + "/health", timeout=5).json()["backends"]
    return backend["cpu_tier_tokens"]


def test_the_budget_binds_once_the_cpu_tier_has_shown_its_size(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    (rank,) = rank_servers.sim(1, cpu_tier_tokens=CPU_TIER_TOKENS, kv_events=True)
    proxy = gateway(
        [rank], kv_events="auto", admission_wait=30, session_idle_ttl=60, target_fraction=FRACTION
    )
    # the rank's metrics say it offloads; its tier's size is not known yet: no budget binds
    wait_until(lambda: (v := rank_view(proxy.url))["pool_tokens"] == KV_TOKENS and v["budget_tokens"] is None)
    assert learned_tier(proxy.url) is None

    # four sessions, though a GPU-only budget (FRACTION x 2,048) seats two: none waits
    for key in "abcd":
        assert chat(proxy.url, key, 700).status_code == 200
        assert metric(proxy.url, "prefixgate_admission_queue_depth") == 0
    assert metric(proxy.url, "prefixgate_admission_queued_total") == 0
    tier = httpx.get(rank.url + "/sim/state", timeout=5).json()["cpu_tier"]
    assert tier["evicted"] > 0, "the sessions overflowed the pool and the tier"

    # the tier's first eviction taught its size: what it held then (a block over: the sim stores
    # the new block before evicting for it)
    learned = wait_until(lambda: learned_tier(proxy.url))
    assert learned in (CPU_TIER_TOKENS, CPU_TIER_TOKENS + BLOCK)
    view = rank_view(proxy.url)
    assert view["budget_tokens"] == int(FRACTION * (KV_TOKENS + learned))
    assert view["working_set_tokens"] > view["budget_tokens"]

    # now it binds: a new session waits for a seat until residents give theirs up
    waiting = Background(lambda: chat(proxy.url, "e", 700))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1)
    for key in "abc":
        assert httpx.delete(f"{proxy.url}/admin/sessions/{key}", timeout=5).status_code in (200, 204)
    assert waiting.result().status_code == 200
    assert metric(proxy.url, "prefixgate_admission_queue_depth") == 0
