"""Health checks judge the rank, never the proxy's own event loop: a loop that lags past the
timeout (a proxy saturated by its clients) must not take a healthy rank out of routing."""

from __future__ import annotations

import asyncio
import socket
import time

from routing.health import HealthChecker
from routing.ranks import Fleet, Rank
from tests.helpers.fixed_answer import fixed_answer


def test_a_rank_answering_in_time_stays_up_while_the_loop_is_blocked_past_the_timeout(rank_servers):
    (stub,) = rank_servers.stub(1)
    rank = Rank(stub.name, stub.url)
    rank.mark_down("not probed yet")
    checker = HealthChecker(Fleet([rank]), timeout=1.0)

    async def probe_behind_a_blocked_loop() -> bool:
        probing = asyncio.ensure_future(checker.check(rank))
        await asyncio.sleep(0)  # the probe is on its way
        time.sleep(3.0)  # the loop does nothing else for three timeouts: a saturated proxy
        return await probing

    try:
        assert asyncio.run(probe_behind_a_blocked_loop()) is True
    finally:
        checker.close()
    assert rank.healthy


def test_a_rank_that_accepts_but_never_answers_is_down_after_the_timeout():
    with socket.socket() as listening:  # the kernel completes the handshake; nobody ever reads
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        port = listening.getsockname()[1]
        rank = Rank("hung", f"http://127.0.0.1:{port}")
        checker = HealthChecker(Fleet([rank]), timeout=0.3)
        try:
            assert asyncio.run(checker.check(rank)) is False
        finally:
            checker.close()
    assert not rank.healthy
    assert rank.last_error == "health check got no answer within 0.3 s"


def test_a_refused_connection_and_a_failing_status_say_what_failed(rank_servers):
    (stub,) = rank_servers.stub(1)
    stub.behavior.healthy = False
    answering = Rank(stub.name, stub.url)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    refusing = Rank("gone", f"http://127.0.0.1:{port}")
    checker = HealthChecker(Fleet([answering, refusing]), timeout=2.0)
    try:
        asyncio.run(checker.check_all())
    finally:
        checker.close()
    assert not answering.healthy and (answering.last_error or "").startswith("GET /health answered 503")
    assert refusing.last_error == f"health check cannot connect to 127.0.0.1:{port}: Connection refused"


def test_a_rank_whose_health_answer_closes_the_connection_is_up():
    # http.client hands the socket to such an answer and clears the connection's: the probe used
    # to fail on it with AttributeError, which ended the checker and left a rank down for good.
    with fixed_answer({"Connection": "close"}) as closing:
        rank = Rank("closing", closing.url)
        rank.mark_down("not probed yet")
        checker = HealthChecker(Fleet([rank]), timeout=2.0)
        try:
            assert asyncio.run(checker.check(rank)) is True
        finally:
            checker.close()
    assert rank.healthy


def test_an_unexpected_probe_failure_marks_the_rank_down_and_the_checker_goes_on(rank_servers):
    (stub,) = rank_servers.stub(1)
    broken = Rank("broken", "http://127.0.0.1:notaport")  # urlsplit's port raises ValueError
    answering = Rank(stub.name, stub.url)
    answering.mark_down("not probed yet")
    checker = HealthChecker(Fleet([broken, answering]), timeout=2.0)

    async def rounds_until_both_are_judged() -> None:
        running = asyncio.ensure_future(checker.run(interval=0.01))
        try:
            deadline = time.monotonic() + 30
            while not (answering.healthy and broken.last_error) and not running.done():
                assert time.monotonic() < deadline, "the checker judged neither rank"
                await asyncio.sleep(0.01)
            assert not running.done()  # the failure did not end the checker
        finally:
            running.cancel()

    try:
        asyncio.run(rounds_until_both_are_judged())
    finally:
        checker.close()
    assert not broken.healthy
    assert (broken.last_error or "").startswith("health check failed: ValueError")
    assert answering.healthy


def test_on_up_is_told_each_time_a_rank_becomes_healthy_and_only_then(rank_servers):
    (stub,) = rank_servers.stub(1)
    rank = Rank(stub.name, stub.url)
    checker = HealthChecker(Fleet([rank]), timeout=2.0)
    came_up: list[str] = []
    checker.on_up = lambda up: came_up.append(up.name)

    async def rounds() -> None:
        await checker.check_all()  # first good probe: up (a rank starts healthy, unprobed)
        await checker.check_all()  # still up: nothing new
        stub.behavior.healthy = False
        await checker.check_all()  # down
        stub.behavior.healthy = True
        await checker.check_all()  # up again
        rank.mark_down("connection failed: refused")  # forwarding noticed it between two probes
        await checker.check_all()  # up again

    try:
        asyncio.run(rounds())
    finally:
        checker.close()
    assert came_up == [stub.name, stub.name, stub.name]
