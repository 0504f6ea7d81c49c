"""The JSON endpoints the dashboard polls, against prefixgate in front of simulated ranks."""

from __future__ import annotations

import httpx

from proxy.config import DEFAULT_TARGET_FRACTION
from tests.dashboard.conftest import SYSTEM, converse


def get(url: str, path: str, token: str | None = None, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(url + path, params=params, headers=headers, timeout=10.0, trust_env=False)


def usage(response: httpx.Response) -> tuple[int, int]:
    u = response.json()["usage"]
    return u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]


def test_overview_reports_the_hits_the_ranks_reported(deployment):
    dep = deployment(2)
    answers = converse(dep.url, "s-one", 4) + converse(dep.url, "s-two", 3, system="Other agent. " * 60)
    prompt = sum(usage(a)[0] for a in answers)
    hits = sum(usage(a)[1] for a in answers)
    assert 0 < hits < prompt  # later turns hit their earlier ones, first turns cannot

    ov = get(dep.url, "/admin/overview").json()
    fleet = ov["fleet"]
    assert fleet["cumulative"] == {
        "requests": 7,
        "prompt_tokens": prompt,
        "hit_tokens": hits,
        "hit_rate": hits / prompt,
        "computed_per_100": 100 * (prompt - hits) / prompt,
    }
    assert fleet["window"]["requests"] == 7 and fleet["window"]["hit_rate"] == hits / prompt
    assert fleet["active_sessions"] == 2 and fleet["healthy_ranks"] == 2

    # per rank: the hits of the answers it gave, and the working set of its active sessions
    by_rank: dict[str, list[httpx.Response]] = {}
    for a in answers:
        by_rank.setdefault(a.headers["x-prefixgate-backend"], []).append(a)
    sessions = get(dep.url, "/admin/sessions").json()["data"]
    for rank in ov["ranks"]:
        mine = by_rank.get(rank["name"], [])
        assert rank["requests"] == len(mine)
        if mine:
            assert rank["hit_rate"] == sum(usage(a)[1] for a in mine) / sum(usage(a)[0] for a in mine)
        held = [s for s in sessions if s["rank"] == rank["name"]]
        assert rank["sessions"] == len(held)
        assert rank["working_set_tokens"] == sum(s["context_tokens"] for s in held)
        assert rank["pool_tokens"] == 65_536
        assert rank["budget_tokens"] == int(65_536 * DEFAULT_TARGET_FRACTION)
        assert rank["occupancy"] == rank["working_set_tokens"] / 65_536
        assert rank["healthy"] is True and rank["in_flight"] == 0

    # the series: stored points plus the live one, which already counts every answer
    fields = ov["series_fields"]
    assert ov["series"] and fields[0] == "time"
    live = dict(zip(fields, ov["live"], strict=True))
    assert live["requests"] == 7 and live["cumulative_rate"] == hits / prompt
    last = ov["series"][-1][0]
    assert get(dep.url, "/admin/overview", since=last).json()["series"] == []
    assert ov["admission"]["enabled"] is True and ov["admission"]["queue_depth"] == 0
    assert ov["admission"]["rejected"] == {}


def test_sessions_table_and_a_session_turn_by_turn(deployment):
    dep = deployment(2)
    converse(dep.url, "s-old", 2)
    answers = converse(dep.url, "s-edit", 3)
    # the system prompt changes: the prefix breaks at turn 3 (turns are numbered from 0)
    answers += converse(dep.url, "s-edit", 5, system=SYSTEM.replace("coding agent", "careful coding agent"))

    rows = get(dep.url, "/admin/overview/sessions").json()
    assert rows["total"] == 2
    assert [r["key"] for r in rows["data"]] == ["s-edit", "s-old"]  # most recently seen first
    edit = rows["data"][0]
    assert edit["turns"] == 8 and edit["active"] is True and edit["idle_s"] >= 0
    assert edit["last_break"]["cause"] == "system_edited" and edit["last_break"]["turn"] == 3
    assert rows["data"][1]["last_break"] is None
    assert edit["hit_rate"] == sum(usage(a)[1] for a in answers) / sum(usage(a)[0] for a in answers)

    detail = get(dep.url, "/admin/overview/sessions/s-edit").json()
    turns = detail["turns_log"]
    assert [t["turn"] for t in turns] == list(range(8))
    assert [(t["prompt_tokens"], t["cached_tokens"]) for t in turns] == [usage(a) for a in answers]
    assert all(t["rank"] == edit["rank"] for t in turns)
    assert turns[3]["cached_tokens"] < turns[2]["cached_tokens"]  # the break's cost
    assert [b["cause"] for b in detail["breaks"]] == ["system_edited"]

    limited = get(dep.url, "/admin/overview/sessions", limit=1, sort="turns", order="asc").json()
    assert [r["key"] for r in limited["data"]] == ["s-old"]
    assert get(dep.url, "/admin/overview/sessions/nope").status_code == 404

    # ending a session drops its turns with it
    assert httpx.delete(dep.url + "/admin/sessions/s-edit", trust_env=False).status_code == 200
    assert get(dep.url, "/admin/overview/sessions/s-edit").status_code == 404
    assert dep.gateway.dashboard.recorder.turns.get("s-edit") == []


def test_bad_parameters_are_answered_400(deployment):
    dep = deployment(1)
    for path, params in (
        ("/admin/overview", {"since": "yesterday"}),
        ("/admin/overview/sessions", {"limit": "0"}),
        ("/admin/overview/sessions", {"limit": "many"}),
        ("/admin/overview/sessions", {"sort": "password"}),
        ("/admin/overview/sessions", {"order": "up"}),
    ):
        response = get(dep.url, path, **params)
        assert response.status_code == 400, (path, params)
        assert response.json()["error"]["param"] == next(iter(params))


def test_the_page_is_self_contained_and_guarded_by_the_admin_token(deployment):
    dep = deployment(1, admin_token="tok")
    for path in ("/dashboard", "/admin/overview", "/admin/overview/sessions"):
        assert get(dep.url, path).status_code == 401
        assert get(dep.url, path, token="wrong").status_code == 401
        assert get(dep.url, path, token="tok").status_code == 200
    page = get(dep.url, "/dashboard", token="tok")
    assert page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    html = page.text
    # nothing fetched from elsewhere: no external scripts, styles or URLs
    assert "<script src" not in html and '<link rel="stylesheet"' not in html
    assert "http://" not in html and "https://" not in html
    for element in ("hitchart", "sessions", "session-detail", "ranks", "kpi-queue", "kpi-rejected"):
        assert f'id="{element}"' in html


def test_a_client_key_sees_only_its_own_sessions(deployment):
    dep = deployment(1, api_keys=["key-a", "key-b"], admin_token="tok")
    converse(dep.url, "mine", 2, {"Authorization": "Bearer key-a"})
    converse(dep.url, "theirs", 2, {"Authorization": "Bearer key-b"})
    rows = get(dep.url, "/admin/overview/sessions", token="key-a").json()
    assert [r["key"] for r in rows["data"]] == ["mine"]
    assert get(dep.url, "/admin/overview/sessions/theirs", token="key-a").status_code == 404
    assert get(dep.url, "/admin/overview/sessions/mine", token="key-a").status_code == 200
    everyone = get(dep.url, "/admin/overview/sessions", token="tok").json()
    assert sorted(r["key"] for r in everyone["data"]) == ["mine", "theirs"]
