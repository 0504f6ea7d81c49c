"""Admission control end to end: real proxies in front of simulated ranks with 2,048-token pools."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from proxy.config import DEFAULT_TARGET_FRACTION
from tests.admission.conftest import KV_TOKENS, Background, chat, metric
from tests.helpers.wait import wait_until

BUDGET = int(KV_TOKENS * DEFAULT_TARGET_FRACTION)


def sessions_of(url: str, **params: str) -> list[dict]:
    answer = httpx.get(url + "/admin/sessions", params={"limit": "100", **params}, timeout=5)
    assert answer.status_code == 200, answer.text
    return answer.json()["data"]


def test_budget_accounting_fills_each_rank_to_its_budget_then_rotates(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(2)
    proxy = gateway(ranks, admission_wait=0.3, session_idle_ttl=60)
    for n in range(4):
        assert chat(proxy.url, f"s{n}", 700).status_code == 200
    rows = sessions_of(proxy.url)
    assert len(rows) == 4
    per_rank: dict[str, int] = {}
    for row in rows:
        assert row["turns"] == 1 and row["active"]
        assert row["context_tokens"] == row["prompt_tokens_sent"] + 16  # the answer joins the context
        per_rank[row["rank"]] = per_rank.get(row["rank"], 0) + row["context_tokens"]
    # two sessions per rank: a third would not fit the 0.8 budget of a 2,048-token pool
    assert sorted(per_rank) == sorted(r.name for r in ranks)
    for name, tokens in per_rank.items():
        assert tokens <= BUDGET
        assert metric(proxy.url, "prefixgate_rank_working_set_tokens", backend=name) == tokens
        assert metric(proxy.url, "prefixgate_sessions_active", backend=name) == 2
        assert metric(proxy.url, "prefixgate_rank_pool_tokens", backend=name) == KV_TOKENS

    # a fifth session is not refused: it waits the rotation bound, then the resident quiet longest
    # (s0, answered first) gives up its seat for it
    assert chat(proxy.url, "s4", 700).status_code == 200
    assert metric(proxy.url, "prefixgate_admission_queued_total") == 1
    assert metric(proxy.url, "prefixgate_admission_rejected_total", reason="pool_full") is None
    parked = httpx.get(f"{proxy.url}/admin/sessions/s0", timeout=5).json()
    assert parked["admission"]["decision"] == "parked" and "for session s4" in parked["admission"]["reason"]
    assert not parked["active"] and parked["parks"] == 1
    seated = httpx.get(f"{proxy.url}/admin/sessions/s4", timeout=5).json()["admission"]
    assert seated["decision"] == "rotated" and seated["parked"] == ["s0"] and seated["waited_s"] >= 0.3
    assert (
        metric(proxy.url, "prefixgate_admission_parked_total", backend=parked["rank"], reason="waiter") == 1
    )
    assert seated["rank"] == parked["rank"]  # the seat s0 gave up

    # an explicit end releases the budget at once: the next session needs no rotation
    assert httpx.delete(f"{proxy.url}/admin/sessions/s1", timeout=5).json()["deleted"] is True
    assert httpx.get(f"{proxy.url}/admin/sessions/s1", timeout=5).status_code == 404
    assert chat(proxy.url, "s5", 700).status_code == 200
    assert httpx.get(f"{proxy.url}/admin/sessions/s5", timeout=5).json()["admission"]["decision"] == "room"
    assert metric(proxy.url, "prefixgate_admission_queued_total") == 1


def test_a_parked_session_waits_for_a_seat_and_resumes(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=0.3, session_idle_ttl=60)
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200
    assert chat(proxy.url, "c", 700).status_code == 200  # a parked for it
    assert httpx.get(f"{proxy.url}/admin/sessions/a", timeout=5).json()["admission"]["decision"] == "parked"
    # a's next turn queues like a newcomer's; b is now quiet longest (c was answered after it)
    assert chat(proxy.url, "a", 760).status_code == 200
    record = httpx.get(f"{proxy.url}/admin/sessions/a", timeout=5).json()
    assert record["admission"]["decision"] == "rotated" and record["admission"]["resumed"] is True
    assert record["admission"]["parked"] == ["b"] and record["turns"] == 2 and record["active"]
    assert metric(proxy.url, "prefixgate_admission_resumed_total") == 1
    assert httpx.get(f"{proxy.url}/admin/sessions/c", timeout=5).json()["active"]


def test_queued_session_is_admitted_when_one_idles_out(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=15, session_idle_ttl=2.0)
    assert chat(proxy.url, "a", 700).status_code == 200
    assert chat(proxy.url, "b", 700).status_code == 200
    answer = chat(proxy.url, "c", 700)  # queued until the longest quiet, a, idles out
    assert answer.status_code == 200
    assert metric(proxy.url, "prefixgate_admission_queued_total") == 1
    assert metric(proxy.url, "prefixgate_admission_queue_depth") == 0
    active = {r["id"] for r in sessions_of(proxy.url, active="1")}
    # b answered after a, so on a slow machine it may still be inside its TTL here
    assert "a" not in active and "c" in active
    wait_until(lambda: {r["id"] for r in sessions_of(proxy.url, active="1")} == {"c"}, "b never idled out")


def test_queue_is_first_come_first_served(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=15, session_idle_ttl=60)
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200
    first = Background(lambda: chat(proxy.url, "first", 700))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1)
    second = Background(lambda: chat(proxy.url, "second", 700))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 2)
    httpx.delete(f"{proxy.url}/admin/sessions/a", timeout=5)  # room for one
    assert first.result().status_code == 200
    assert metric(proxy.url, "prefixgate_admission_queue_depth") == 1
    httpx.delete(f"{proxy.url}/admin/sessions/b", timeout=5)
    assert second.result().status_code == 200


def test_a_seated_sessions_own_turns_are_never_held(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    # contexts are a prompt's tokens plus 16 answered: a 727, b 727, c 627 against a 2,048-token pool
    ranks = rank_servers.sim(1)
    name = ranks[0].name
    proxy = gateway(ranks, admission_wait=30, session_idle_ttl=60)
    assert chat(proxy.url, "a", 700).status_code == 200
    assert chat(proxy.url, "b", 700).status_code == 200
    waiting = Background(lambda: chat(proxy.url, "c", 600, timeout=30))  # full: c waits
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1)
    assert chat(proxy.url, "a", 900).status_code == 200  # a grows: served at once, c still waits
    assert metric(proxy.url, "prefixgate_admission_queue_depth") == 1
    # a grows with b past the pool: served at once; the quiet b gives up its seat rather than lose
    # its blocks to a's next turns, and c takes the room (a and c fit the pool)
    assert chat(proxy.url, "a", 1360).status_code == 200
    assert waiting.result().status_code == 200
    b = httpx.get(f"{proxy.url}/admin/sessions/b", timeout=5).json()
    assert b["admission"]["decision"] == "parked" and "outgrew its pool" in b["admission"]["reason"]
    # a grows past the pool with c: served at once again, and the quiet c is parked in turn
    assert chat(proxy.url, "a", 1700).status_code == 200
    c_url = f"{proxy.url}/admin/sessions/c"
    wait_until(lambda: httpx.get(c_url, timeout=5).json()["admission"]["decision"] == "parked")
    rows = {r["id"]: r for r in sessions_of(proxy.url)}
    assert rows["a"]["turns"] == 4 and rows["a"]["active"]
    assert not rows["b"]["active"] and not rows["c"]["active"]
    assert metric(proxy.url, "prefixgate_rank_over_pool", backend=name) == 0
    assert metric(proxy.url, "prefixgate_admission_parked_total", backend=name, reason="pool") == 2
    working_set = metric(proxy.url, "prefixgate_rank_working_set_tokens", backend=name)
    assert working_set == rows["a"]["context_tokens"]
    assert metric(proxy.url, "prefixgate_admission_rejected_total", reason="queue_full") is None


def test_a_queue_past_its_length_is_refused_with_retry_after(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=30, admission_queue=1, session_idle_ttl=60)
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200
    first = Background(lambda: chat(proxy.url, "c", 700, timeout=2.0))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1)
    refused = chat(proxy.url, "d", 700)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "admission_queue_full"
    assert metric(proxy.url, "prefixgate_admission_rejected_total", reason="queue_full") == 1
    httpx.delete(f"{proxy.url}/admin/sessions/a", timeout=5)  # the waiter gets the seat
    assert first.result().status_code == 200


def test_client_key_session_cap_and_visibility(rank_servers, gateway, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {key: key-alice, label: alice, max_sessions: 1}\n- {key: key-bob, label: bob}\n")
    proxy = gateway(ranks, api_keys_file=str(keys), admission_wait=0.1, session_idle_ttl=60)
    alice = {"authorization": "Bearer key-alice"}
    bob = {"authorization": "Bearer key-bob"}
    assert chat(proxy.url, "alice-1", 100, alice).status_code == 200
    assert chat(proxy.url, "alice-1", 150, alice).status_code == 200  # her own session goes on
    refused = chat(proxy.url, "alice-2", 100, alice)
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "too_many_sessions"
    assert "retry-after" in refused.headers
    assert chat(proxy.url, "bob-1", 100, bob).status_code == 200
    # a client key sees its own sessions only
    mine = httpx.get(proxy.url + "/admin/sessions", headers=alice, timeout=5).json()["data"]
    assert [(r["id"], r["client"]) for r in mine] == [("alice-1", "alice")]
    assert httpx.get(proxy.url + "/admin/sessions/bob-1", headers=alice, timeout=5).status_code == 404
    assert metric(proxy.url, "prefixgate_admission_rejected_total", bob, reason="client_sessions") == 1


def test_no_admission_admits_past_the_budget(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, no_admission=True, admission_wait=0.1, session_idle_ttl=60)
    for key in ("a", "b", "c"):
        assert chat(proxy.url, key, 700).status_code == 200
    assert len(sessions_of(proxy.url, active="1")) == 3


def test_two_replicas_share_sessions_through_redis(rank_servers, gateway, redis_server) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    options = {"redis_url": redis_server.url, "admission_wait": 30, "session_idle_ttl": 60}
    one = gateway(ranks, **options)
    two = gateway(ranks, **options)
    assert chat(one.url, "a", 700).status_code == 200
    assert chat(one.url, "b", 700).status_code == 200
    # the other replica sees the rank full through the shared table: c waits there
    assert {r["id"] for r in sessions_of(two.url)} == {"a", "b"}
    waiting = Background(lambda: chat(two.url, "c", 700))
    wait_until(lambda: metric(two.url, "prefixgate_admission_queue_depth") == 1)
    # a turn of a on the other replica continues the same record
    assert chat(two.url, "a", 750).status_code == 200
    # the other replica saves behind (proxy/state/redis/sessions.py): one sees it a queue's wait later
    record = wait_until(
        lambda: (r := httpx.get(f"{one.url}/admin/sessions/a", timeout=5).json())["turns"] == 2 and r
    )
    assert record["rank"] == ranks[0].name
    # an end on one replica frees the seat for the other's waiter
    assert httpx.delete(f"{one.url}/admin/sessions/b", timeout=5).status_code == 200
    assert waiting.result().status_code == 200
    assert httpx.get(f"{one.url}/admin/sessions/c", timeout=5).json()["admission"]["decision"] == "room"


def test_hit_rate_gauges_follow_what_the_ranks_report(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, session_idle_ttl=60)
    for tokens in (300, 400, 500):  # each turn extends the previous prompt: later turns hit
        assert chat(proxy.url, "a", tokens).status_code == 200
    assert chat(proxy.url, "b", 200).status_code == 200
    rows = {r["id"]: r for r in sessions_of(proxy.url)}
    a = rows["a"]
    assert a["hit_tokens_reported"] > 0
    assert a["prefill_tokens"] == a["prompt_tokens_sent"] - a["hit_tokens_reported"]
    assert a["hit_tokens_estimated"] > 0
    name = ranks[0].name
    assert metric(proxy.url, "prefixgate_session_hit_rate", session="a", backend=name) == a["hit_rate"]
    sent = sum(r["prompt_tokens_sent"] for r in rows.values())
    hits = sum(r["hit_tokens_reported"] for r in rows.values())
    assert metric(proxy.url, "prefixgate_fleet_hit_rate") == hits / sent


def test_admin_list_sorts_and_paginates(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(2)
    proxy = gateway(ranks, session_idle_ttl=60)
    for n, tokens in enumerate((50, 300, 120, 200)):
        assert chat(proxy.url, f"s{n}", tokens).status_code == 200
    by_size = sessions_of(proxy.url, sort="context_tokens", order="asc")
    assert [r["id"] for r in by_size] == ["s0", "s2", "s3", "s1"]
    page = httpx.get(
        proxy.url + "/admin/sessions",
        params={"sort": "context_tokens", "order": "desc", "limit": "2", "offset": "1"},
        timeout=5,
    ).json()
    assert page["total"] == 4 and [r["id"] for r in page["data"]] == ["s3", "s2"]
    bad = httpx.get(proxy.url + "/admin/sessions", params={"sort": "nope"}, timeout=5)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sort"


def test_a_client_that_leaves_the_queue_frees_its_place(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=30, session_idle_ttl=60)
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200
    impatient = Background(lambda: chat(proxy.url, "c", 700, timeout=1.0))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1)
    try:
        impatient.result()
        raise AssertionError("the queued request should have timed out on the client side")
    except httpx.TimeoutException:
        pass
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 0)
    assert httpx.get(f"{proxy.url}/admin/sessions/c", timeout=5).status_code == 404


@pytest.mark.parametrize("header", ["x-prefixgate-session-end", "x-dynamo-session-final"])
def test_a_session_that_says_it_ended_frees_its_seat_at_once(rank_servers, gateway, header: str) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=600, session_idle_ttl=600)  # nothing rotates or idles out
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200
    waiting = Background(lambda: chat(proxy.url, "c", 700))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth") == 1)
    assert chat(proxy.url, "a", 720, {header: "false"}).status_code == 200  # not its last: no change
    assert metric(proxy.url, "prefixgate_admission_queue_depth") == 1
    assert chat(proxy.url, "a", 740, {header: "true"}).status_code == 200  # its last request
    assert waiting.result().status_code == 200  # c takes the seat a freed
    ended = httpx.get(f"{proxy.url}/admin/sessions/a", timeout=5).json()
    assert ended["admission"]["decision"] == "ended" and not ended["active"] and ended["turns"] == 3
    assert httpx.get(f"{proxy.url}/admin/sessions/c", timeout=5).json()["admission"]["decision"] == "room"


def test_a_higher_class_gets_a_seat_before_earlier_waiters_only_with_the_grant(  # type: ignore[no-untyped-def]
    rank_servers, gateway, tmp_path: Path
) -> None:
    ranks = rank_servers.sim(1)
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "- {key: key-batch, label: batch}\n"
        "- {key: key-vip, label: vip, max_priority: 5}\n"
        "- {key: key-plain, label: plain}\n"
    )
    proxy = gateway(ranks, api_keys_file=str(keys), admission_wait=600, session_idle_ttl=600)
    batch = {"authorization": "Bearer key-batch"}
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700, batch).status_code == 200  # the pool is full
    earlier = Background(lambda: chat(proxy.url, "early", 700, batch, timeout=3.0))
    wait_until(lambda: metric(proxy.url, "prefixgate_admission_queue_depth", batch) == 1)
    # a key without the grant asks for class 5 and gets its own class 0: it waits behind
    plain = {"authorization": "Bearer key-plain", "x-prefixgate-priority": "5"}
    with pytest.raises(httpx.TimeoutException):
        chat(proxy.url, "pretender", 700, plain, timeout=1.0)
    # the granted key's class 5 parks a quiet class-0 session at once, before the earlier waiter
    vip = {"authorization": "Bearer key-vip", "x-prefixgate-priority": "5"}
    assert chat(proxy.url, "vip", 700, vip).status_code == 200
    seated = httpx.get(f"{proxy.url}/admin/sessions/vip", headers=vip, timeout=5).json()
    assert seated["admission"]["decision"] == "rotated" and seated["priority"] == 5
    # quiet longest of the lower class; named to the vip's client only as another client's session
    assert seated["admission"]["parked"] == ["a session of another client"]
    parked = httpx.get(f"{proxy.url}/admin/sessions/a", headers=batch, timeout=5).json()["admission"]
    assert parked["decision"] == "parked" and parked["reason"].startswith("parked for a session of another")
    try:
        earlier.result()
        raise AssertionError("the earlier class-0 waiter should still have been waiting")
    except httpx.TimeoutException:
        pass
