"""Every request no rank could take says which rank and why, and leaves a warning in the log
(issue 49: a bare 503 "no healthy backend", logged nowhere)."""

from __future__ import annotations

import logging

import httpx

from proxy.unavailable import Refusals, private
from routing.ranks import Fleet, Rank

CHAT = {"model": "model-0", "messages": [{"role": "user", "content": "hi"}]}


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_503_names_the_down_rank_and_its_reason_and_is_logged(rank_servers, proxy, caplog):
    (rank,) = rank_servers.stub(1)
    rank.stop()
    port = rank.server.port
    with caplog.at_level(logging.WARNING, logger="prefixgate"):
        server = proxy([rank])
        response = httpx.post(
            server.url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": "s-503"}
        )
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "no_healthy_backend" and error["type"] == "service_unavailable"
    message = error["message"]
    assert message.startswith("no healthy backend can serve this request: ")
    assert f"{rank.name} is down" in message and "cannot connect" in message, message
    assert str(port) not in message  # where the rank is stays private, as on /ready
    (line,) = [m for m in warnings_of(caplog) if m.startswith("503 ")]
    assert "session s-503" in line and f"{rank.name} is down" in line
    assert f"127.0.0.1:{port}" in line  # the operator's log keeps the address


def test_models_503_says_the_same(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    rank.stop()
    server = proxy([rank])
    error = httpx.get(server.url + "/v1/models").json()["error"]
    assert error["code"] == "no_healthy_backend" and f"{rank.name} is down" in error["message"]


def test_a_502_names_every_rank_tried_and_its_failure(rank_servers, proxy, caplog):
    first, second = rank_servers.stub(2)
    first.behavior.status = 500
    second.behavior.status = 503
    with caplog.at_level(logging.WARNING, logger="prefixgate"):
        server = proxy([first, second])
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "each of the 2 ranks tried failed" in message
    assert f"{first.name} answered HTTP 500" in message and f"{second.name} answered HTTP 503" in message
    (line,) = [m for m in warnings_of(caplog) if m.startswith("502 ")]
    assert "/v1/chat/completions" in line and first.name in line and second.name in line


def test_a_rank_without_room_is_named_beside_the_down_one():
    down = Rank("gpu-0", "http://10.0.0.5:8000", healthy=False, last_error="GET /health answered 500")
    full = Rank("gpu-1", "http://10.0.0.6:8000")
    error = Refusals().no_rank(Fleet([down, full]), "session s", allowed={"gpu-0"})
    assert error.status == 503
    assert "gpu-0 is down: GET /health answered 500" in error.message
    assert "gpu-1 has no room for a new session" in error.message


def test_the_address_is_taken_out_of_the_clients_message():
    rank = Rank("gpu-0", "http://10.0.0.5:8000")
    for reason in (
        "health check cannot connect to 10.0.0.5:8000: Connection refused",
        "connection failed: [Errno 111] Connect call failed ('10.0.0.5', 8000)",
        "GET http://10.0.0.5:8000/health timed out",
    ):
        shown = private(reason, rank)
        assert "10.0.0.5" not in shown and "gpu-0" in shown, shown


def test_refusals_are_logged_once_a_second_with_the_count_of_the_others(caplog):
    now = [100.0]
    refusals = Refusals(clock=lambda: now[0])
    fleet = Fleet([Rank("gpu-0", "http://10.0.0.5:8000", healthy=False, last_error="down")])
    with caplog.at_level(logging.WARNING, logger="prefixgate"):
        for _ in range(5):
            refusals.no_rank(fleet, "a request")
        now[0] += 1.5
        refusals.no_rank(fleet, "a request")
    lines = warnings_of(caplog)
    assert len(lines) == 2
    assert "more refused" not in lines[0]
    assert lines[1].endswith("(and 4 more refused since the last such line)")
