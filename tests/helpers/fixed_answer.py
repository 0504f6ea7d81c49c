"""A blocking HTTP/1.1 server on 127.0.0.1 that answers every GET with the same 200 and the headers
a test gives it, remembering each request's headers: for clients whose handling of one header is
under test (a ``Connection: close``, a ``Set-Cookie``)."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from email.message import Message


@dataclass
class FixedAnswer:
    """The running server: its ``url`` and the headers of every request it answered."""

    url: str
    received: list[Message] = field(default_factory=list)


@contextlib.contextmanager
def fixed_answer(headers: Mapping[str, str], body: bytes = b"ok") -> Iterator[FixedAnswer]:
    """Serves until the ``with`` block ends; every GET gets 200, ``headers`` and ``body``."""
    answer = FixedAnswer("")

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            answer.received.append(self.headers)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            for name, value in headers.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    answer.url = f"http://127.0.0.1:{server.server_port}"
    try:
        yield answer
    finally:
        server.shutdown()
        server.server_close()
