"""The ranks' client keeps no cookies: it carries every client's requests, so a cookie a rank set
in one answer would otherwise go along with every later request, whoever sent it."""

from __future__ import annotations

import asyncio

from proxy.stages.forward import upstream_session
from tests.helpers.fixed_answer import fixed_answer


def test_a_cookie_a_rank_set_is_not_sent_on_later_requests():
    with fixed_answer({"Set-Cookie": "session=client-a; Path=/"}) as rank:
        # a host name, not an address: aiohttp's default jar keeps no cookies of IP addresses, and
        # ranks are usually named (a Kubernetes service, a host)
        url = rank.url.replace("127.0.0.1", "localhost") + "/v1/models"

        async def two_requests() -> None:
            async with upstream_session(5.0, 5.0) as session:
                for _ in range(2):
                    async with session.get(url) as answer:
                        assert answer.status == 200
                        assert answer.headers["Set-Cookie"].startswith("session=client-a")  # relayed
                        await answer.read()

        asyncio.run(two_requests())
    assert [headers.get("Cookie") for headers in rank.received] == [None, None]
