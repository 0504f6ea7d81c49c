"""Each admission decision is visible: ``/admin/sessions/{id}`` and the dashboard's JSON say why a
session waited, where it went and whom it was parked for; metrics count decisions, waits, parks and
the clocks in force."""

from __future__ import annotations

import time

import httpx

from tests.admission.conftest import Background, chat, metric
from tests.helpers.wait import wait_until


def test_the_session_and_the_dashboard_say_why_and_where(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(2)
    proxy = gateway(ranks, admission_wait=0.05)  # the default admission, the learned idle TTL
    for key in ("a", "b", "c", "d"):
        assert chat(proxy.url, key, 700).status_code == 200  # two per rank fill both budgets
    assert chat(proxy.url, "e", 700).status_code == 200  # full: never refused, a seat rotates to it

    first = httpx.get(proxy.url + "/admin/sessions/b", timeout=5).json()["admission"]
    assert first["decision"] == "room" and first["rank"] in {r.name for r in ranks}
    assert first["waited_s"] == 0 and first["reason"] == "room within the budget"
    assert first["allowed"] == sorted(r.name for r in ranks) and not first["resumed"]

    late = httpx.get(proxy.url + "/admin/sessions/e", timeout=5).json()["admission"]
    assert late["decision"] == "rotated" and late["waited_s"] >= 0.05 and late["parked"] == ["a"]
    parked = httpx.get(proxy.url + "/admin/sessions/a", timeout=5).json()["admission"]
    assert parked["decision"] == "parked" and "for session e" in parked["reason"]
    listed = httpx.get(proxy.url + "/admin/sessions", timeout=5).json()["data"]
    assert all(set(row["admission"]) == {"decision", "waited_s", "rank"} for row in listed)

    detail = httpx.get(proxy.url + "/admin/overview/sessions/e", timeout=5).json()
    assert detail["admission"]["decision"] == "rotated"
    whole = httpx.get(proxy.url + "/admin/overview", timeout=5).json()
    # each rank's own metrics, polled with the health checks
    assert all(r["waiting_requests"] == 0 and r["kv_cache_usage"] is not None for r in whole["ranks"])
    overview = whole["admission"]
    assert overview["decisions"] == {"room": 4, "rotated": 1}
    assert overview["clocks"]["wait_bound_s"] == 0.05 and overview["clocks"]["idle_ttl_s"] > 0
    assert sum(overview["parked"].values()) == 1 and overview["resumed"] == 0

    assert metric(proxy.url, "prefixgate_admission_decisions_total", decision="room") == 4
    assert metric(proxy.url, "prefixgate_admission_decisions_total", decision="rotated") == 1
    assert metric(proxy.url, "prefixgate_admission_wait_bound_seconds") == 0.05
    parks = [
        metric(proxy.url, "prefixgate_admission_parked_total", backend=r.name, reason="waiter") for r in ranks
    ]
    assert sum(n or 0 for n in parks) == 1


def test_a_seat_that_could_not_rotate_in_time_is_counted(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    (rank,) = rank_servers.sim(1)
    proxy = gateway([rank], admission_wait=0.05, session_idle_ttl=60)
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200  # the rank's budget is full
    rank.set_faults(hang=True)
    # both residents' next turns are in flight: neither is quiet, so neither can be parked for c
    busy = [Background(lambda key=key: chat(proxy.url, key, 720)) for key in ("a", "b")]
    waiting = Background(lambda: chat(proxy.url, "c", 700))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1, "c never queued")
    time.sleep(0.5)  # ten bounds
    assert metric(proxy.url, "prefixgate_admission_waits_past_bound_total", reason="busy") is None
    rank.clear_faults()
    assert all(b.result().status_code == 200 for b in busy)
    assert waiting.result().status_code == 200
    seated = httpx.get(proxy.url + "/admin/sessions/c", timeout=5).json()["admission"]
    assert seated["decision"] == "rotated" and seated["waited_s"] >= 0.5
    # late because both residents were busy: neither could be parked
    assert metric(proxy.url, "prefixgate_admission_waits_past_bound_total", reason="busy") == 1
