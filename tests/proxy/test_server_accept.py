"""The serving loop accepts every waiting connection at once, however busy it is (issue 11).

With uvloop (libuv >= 1.49) the listening socket yields one connection per event-loop iteration; a
proxy whose iterations each carry hundreds of streams then left new clients in the kernel's accept
queue for minutes (1,000 sessions through one process: requests waiting over 120 s). The loop's
iterations are counted here, not timed: every connection queued while the loop was blocked must be
answered within a few iterations of each other.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import uvicorn

from proxy.server import free_port, uvicorn_config
from tests.helpers.wait import wait_until

CONNECTIONS = 48
#: Iterations allowed between the first and the last answer: accept, parse and answer take a few
#: each; one accept per iteration would spread them over at least ``CONNECTIONS`` iterations.
MAX_SPREAD = CONNECTIONS // 4


class IterationCountingApp:
    """Answers every request with the loop iteration it ran in; can block its loop on demand."""

    def __init__(self) -> None:
        self.iteration = 0
        self.block = threading.Event()
        self.blocked = threading.Event()
        self.release = threading.Event()
        self._spinner: asyncio.Task[None] | None = None

    async def _spin(self) -> None:
        while True:
            if self.block.is_set():
                self.block.clear()
                self.blocked.set()
                self.release.wait(10)  # blocks the whole loop: connections pile up in the backlog
            self.iteration += 1
            await asyncio.sleep(0)  # exactly one loop iteration

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    self._spinner = asyncio.ensure_future(self._spin())
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    if self._spinner is not None:
                        self._spinner.cancel()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = str(self.iteration).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(body))],
            }
        )
        await send({"type": "http.response.body", "body": body})


def read_answer(sock: socket.socket) -> int:
    data = b""
    while b"\r\n\r\n" not in data or not data.split(b"\r\n\r\n", 1)[1]:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed early: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200"), head
    return int(body)


def serve_like_prefixgate(app: Any, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    """``uvicorn.Server.run`` as ``prefixgate serve`` calls it: on the event loop its config names."""
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()

    def started() -> bool:
        if server.started:
            return True
        assert thread.is_alive(), "the server did not start"
        return False

    wait_until(started, "the server did not start", timeout=20, interval=0.01)
    return server, thread


def test_connections_queued_while_busy_are_accepted_together() -> None:
    app = IterationCountingApp()
    port = free_port()
    server, thread = serve_like_prefixgate(app, port)
    sockets: list[socket.socket] = []
    try:
        app.block.set()
        assert app.blocked.wait(10), "the server loop never blocked"
        for _ in range(CONNECTIONS):  # the kernel completes these handshakes: the loop is stuck
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            sock.sendall(b"GET / HTTP/1.1\r\nhost: test\r\n\r\n")
            sockets.append(sock)
        app.release.set()
        iterations = [read_answer(sock) for sock in sockets]
    finally:
        app.release.set()
        for sock in sockets:
            sock.close()
        server.should_exit = True
        thread.join(15)
    spread = max(iterations) - min(iterations)
    assert spread <= MAX_SPREAD, f"answers spread over {spread} loop iterations: {sorted(iterations)}"
