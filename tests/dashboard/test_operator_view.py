"""What the dashboard tells an operator beyond the hit rate (issue 21): traffic (request rate, time to
first byte, errors, 429s), the active settings, and a login page for a browser without the token."""

from __future__ import annotations

import threading

import httpx
import pytest

from proxy.ops.traffic import RATE_SPAN_S, Traffic
from tests.dashboard.conftest import converse
from tests.helpers.wait import wait_until

HTML = "text/html; charset=utf-8"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_traffic_rate_percentiles_and_classes():
    clock = Clock()
    traffic = Traffic(size=100, clock=clock)
    clock.now += 10  # a process 10 s old: the rate is over those 10 s
    for i in range(20):
        traffic.add(200, (i + 1) / 1000)
    traffic.add(429)
    traffic.add(503)
    traffic.add(200, 0.5, broken=True)  # a stream that broke after its 200: an error
    traffic.add(499)
    summary = traffic.summary()
    window, total = summary["window"], summary["total"]
    assert summary["requests_per_s"] == pytest.approx(24 / 10)
    assert window["ttfb_requests"] == 21
    assert window["ttfb_p50_ms"] == pytest.approx(11) and window["ttfb_p99_ms"] == pytest.approx(500)
    assert (window["errors"], window["rate_limited"]) == (2, 1)
    assert total == {"requests": 24, "errors": 2, "rate_limited": 1, "client_closed": 1}

    clock.now += RATE_SPAN_S + 1  # a quiet minute later: no rate, the window and totals remain
    assert traffic.summary()["requests_per_s"] == 0
    assert traffic.summary()["window"]["requests"] == 24


def test_a_full_window_inside_a_minute_gives_the_rate_it_spans():
    clock = Clock()
    traffic = Traffic(size=10, clock=clock)
    clock.now += 100
    for _ in range(30):  # 30 answers over 3 s, 10 kept: 10 answers in the last 0.9 s
        clock.now += 0.1
        traffic.add(200, 0.01)
    assert traffic.summary()["requests_per_s"] == pytest.approx(10 / 0.9)


def post(url: str, session: str, messages: object) -> httpx.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 4}
    return httpx.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session})


def test_overview_carries_traffic_and_settings(deployment):
    dep = deployment(2, admission_wait=0, max_sessions_per_rank=1)
    converse(dep.url, "t-one", 3)
    converse(dep.url, "t-two", 1)
    hello = [{"role": "user", "content": "hello"}]
    # both ranks hold their one session: a quiet one is parked for it at once (a bound of 0)
    assert post(dep.url, "t-three", hello).status_code == 200
    assert post(dep.url, "t-four", "not a list").status_code == 400
    ov = httpx.get(dep.url + "/admin/overview", trust_env=False).json()
    traffic, settings = ov["traffic"], ov["settings"]
    assert traffic["total"] == {"requests": 6, "errors": 0, "rate_limited": 0, "client_closed": 0}
    assert traffic["window"]["ttfb_requests"] == 5 and traffic["window"]["rate_limited"] == 0
    assert sum(ov["admission"]["parked"].values()) == 1
    assert traffic["requests_per_s"] > 0
    assert 0 < traffic["window"]["ttfb_p50_ms"] <= traffic["window"]["ttfb_p99_ms"]
    assert settings["policy"] == "prefix_affinity" and settings["canonicalize"] is True
    assert settings["admission"] is True and settings["admission_wait"] == 0
    assert settings["max_sessions_per_rank"] == 1
    assert settings["state"] == "memory" and settings["kv_events"] is False and settings["exact_ranks"] == []
    assert settings["block_size"] == 16 and settings["tokenizer"] == "tiktoken"
    assert "redis_url" not in settings and "admin_token" not in settings

    for rank in dep.ranks:
        rank.set_faults(refuse_connections=True)
    # the first request may find a rank still marked up (502 after its retry), then 503s follow
    for _ in range(2):
        assert post(dep.url, "t-one", hello).status_code in (502, 503)
    total = httpx.get(dep.url + "/admin/overview", trust_env=False).json()["traffic"]["total"]
    assert total["errors"] == 2 and total["requests"] == 8


def test_a_browser_without_the_token_gets_a_login_page(deployment):
    dep = deployment(1, admin_token="the-token")
    missing = httpx.get(dep.url + "/dashboard", trust_env=False)
    assert missing.status_code == 401 and missing.headers["content-type"] == HTML
    assert missing.headers["www-authenticate"].startswith("Bearer")
    assert "default-src 'none'" in missing.headers["content-security-policy"]
    assert '<form id="login">' in missing.text and 'data-reason="missing"' in missing.text
    assert "admin token prefixgate was started with" in missing.text
    wrong = httpx.get(dep.url + "/dashboard", params={"token": "nope"}, trust_env=False)
    assert wrong.status_code == 401 and 'data-reason="refused"' in wrong.text
    right = httpx.get(dep.url + "/dashboard", params={"token": "the-token"}, trust_env=False)
    assert right.status_code == 200 and 'id="hitchart"' in right.text
    # the JSON endpoints stay JSON: only the page is for browsers
    data = httpx.get(dep.url + "/admin/overview", trust_env=False)
    assert data.status_code == 401 and data.json()["error"]["code"] == "invalid_api_key"


def test_with_client_keys_only_the_login_page_asks_for_a_key(deployment):
    dep = deployment(1, api_keys=["sk-alice"])
    page = httpx.get(dep.url + "/dashboard", trust_env=False)
    assert page.status_code == 401 and "needs a client API key" in page.text
    assert httpx.get(dep.url + "/dashboard", params={"token": "sk-alice"}, trust_env=False).status_code == 200


def test_a_full_admission_queue_counts_as_rate_limited(deployment):
    dep = deployment(1, admission_wait=600, max_sessions_per_rank=1, admission_queue=1)
    converse(dep.url, "q-one", 1)
    hello = [{"role": "user", "content": "hello"}]
    waiting: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: waiting.append(post(dep.url, "q-two", hello)))
    thread.start()  # no seat rotates within the test: it waits for q-one's
    wait_until(
        lambda: (
            httpx.get(dep.url + "/admin/overview", trust_env=False).json()["admission"]["queue_depth"] == 1
        )
    )
    refused = post(dep.url, "q-three", hello)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "admission_queue_full"
    assert httpx.delete(dep.url + "/admin/sessions/q-one", trust_env=False).status_code == 200
    thread.join(10)
    assert waiting and waiting[0].status_code == 200
    total = httpx.get(dep.url + "/admin/overview", trust_env=False).json()["traffic"]["total"]
    assert total["rate_limited"] == 1 and total["requests"] == 3
