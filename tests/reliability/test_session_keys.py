"""Session keys chosen by clients: any text is answered, safely echoed, bounded, and never leaks a
rank's in-flight count."""

from __future__ import annotations

import re
from urllib.parse import unquote

import httpx
import pytest

from proxy.tenants import MAX_KEY_CHARS
from tests.helpers.wait import wait_until
from tests.reliability.conftest import chat, sse_events

HOSTILE_KEYS = ["用户", "line\nbreak", "nul\x00byte", "esc\x1b[31mred", "tab\there", "100%", " spaced "]


def in_flight(url: str, rank: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=5).text
    found = re.search(rf'^prefixgate_in_flight{{backend="{rank}"}} (\S+)$', metrics, re.M)
    assert found, metrics
    return float(found.group(1))


def test_non_latin1_session_keys_answer_and_release_the_rank(rank_servers, gateway):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank])
    with httpx.Client(base_url=proxy.url, timeout=10) as client:
        for i in range(30):
            body = chat(f"hello {i}", stream=i % 3 != 0, user="用户")
            response = client.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            if body["stream"]:
                assert sse_events(response.text)[-1] == "[DONE]"
            assert unquote(response.headers["x-prefixgate-session"]) == "用户"
    # every stream released its rank: the count is back to zero
    wait_until(lambda: in_flight(proxy.url, rank.name) == 0.0, "a stream kept the rank's in-flight count")


@pytest.mark.parametrize("field", ["user", "prompt_cache_key", "metadata.user_id", "header"])
def test_control_characters_in_keys_get_an_answer(rank_servers, gateway, field):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank])
    seen = set()
    sent = 0
    for key in HOSTILE_KEYS:
        body = chat("hi", stream=True)
        headers = {}
        if field == "metadata.user_id":
            body["metadata"] = {"user_id": key}
        elif field == "header":
            if any(c < " " and c != "\t" for c in key) or not key.isascii() or key != key.strip():
                continue  # not sendable in a header (refused by the client or by the HTTP parser)
            headers["x-session-id"] = key
        else:
            body[field] = key
        response = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert response.status_code == 200, (key, response.text)
        shown = response.headers["x-prefixgate-session"]
        assert shown.isascii() and shown.isprintable() and " " not in shown
        assert unquote(shown) == key
        seen.add(shown)
        sent += 1
    assert len(seen) == sent  # distinct keys stay distinct sessions
    wait_until(lambda: in_flight(proxy.url, rank.name) == 0.0, "a stream kept the rank's in-flight count")


def test_huge_keys_are_bounded_everywhere(rank_servers, gateway):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank])
    keys = ["k" * 65_536, "k" * 65_535 + "j"]
    shown = []
    for key in keys:
        response = httpx.post(proxy.url + "/v1/chat/completions", json=chat("hi", user=key), timeout=10)
        assert response.status_code == 200
        shown.append(response.headers["x-prefixgate-session"])
    assert all(len(s) <= MAX_KEY_CHARS for s in shown)
    assert shown[0] != shown[1]  # the digest tells them apart
    ids = [row["id"] for row in httpx.get(proxy.url + "/admin/sessions", timeout=5).json()["data"]]
    assert sorted(ids) == sorted(shown)
    assert len(httpx.get(proxy.url + "/metrics", timeout=5).content) < 64 * 1024
