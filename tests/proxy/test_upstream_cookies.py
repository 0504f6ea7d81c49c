"""The ranks' client keeps no cookies: it carries every client's requests, so a cookie a rank set
in one answer would otherwise go along with every later request, whoever sent it."""

from __future__ import annotations

import asyncio
import http.server
import threading
from typing import ClassVar

from proxy.stages.forward import upstream_session


class _SetsCookies(http.server.BaseHTTPRequestHandler):
    """Answers every GET with a ``Set-Cookie`` and remembers the ``Cookie`` header it was sent."""

    protocol_version = "HTTP/1.1"
    cookies_seen: ClassVar[list[str | None]] = []

    def do_GET(self) -> None:
        type(self).cookies_seen.append(self.headers.get("Cookie"))
        self.send_response(200)
        self.send_header("Set-Cookie", "session=client-a; Path=/")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:
        pass


def test_a_cookie_a_rank_set_is_not_sent_on_later_requests():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SetsCookies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # a host name, not an address: aiohttp's default jar keeps no cookies of IP addresses, and ranks
    # are usually named (a Kubernetes service, a host)
    url = f"http://localhost:{server.server_port}/v1/models"

    async def two_requests() -> None:
        async with upstream_session(5.0, 5.0) as session:
            for _ in range(2):
                async with session.get(url) as answer:
                    assert answer.status == 200
                    assert answer.headers["Set-Cookie"].startswith("session=client-a")  # still relayed
                    await answer.read()

    try:
        asyncio.run(two_requests())
    finally:
        server.shutdown()
        server.server_close()
    assert _SetsCookies.cookies_seen == [None, None]
