"""Running an ASGI app with uvicorn: in the foreground (``prefixgate serve``) or in a thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any, cast

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def uvicorn_config(
    app: Any,
    host: str,
    port: int,
    log_level: str = "warning",
    event_loop: str = "asyncio",
    *,
    graceful_shutdown: float = 10.0,
) -> uvicorn.Config:
    """The serving config of ``prefixgate serve`` (and of ``ServerThread``). ``graceful_shutdown``:
    on SIGTERM uvicorn stops listening and lets in-flight requests (streams too) finish this long,
    then cancels them and runs the app's shutdown."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        # Not uvloop: its libuv (>= 1.49) accepts one connection per loop iteration, so a proxy whose
        # iterations each carry hundreds of streams left new clients in the kernel's accept queue for
        # minutes (issue 11: 1,000 sessions, requests waiting over 120 s). asyncio's loop accepts
        # every waiting connection at once, for ~5 % less throughput.
        loop=event_loop,
        http="httptools",
        access_log=False,
        # (uvicorn annotates it int; it is seconds handed to asyncio.wait_for, so a float works)
        timeout_graceful_shutdown=cast(Any, graceful_shutdown),
        lifespan="on",
    )


class ServerThread:
    """An ASGI app served by uvicorn on its own event loop in a background thread.

    ``start()`` returns once the server listens; ``stop()`` shuts it down gracefully.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.host = host
        self.port = port or free_port(host)
        self.server = uvicorn.Server(uvicorn_config(app, self.host, self.port, log_level))
        self._thread = threading.Thread(target=self._run, name=f"uvicorn-{self.port}", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as exc:  # surfaced by start()
            self._error = exc

    def start(self, timeout: float = 20.0) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"server on port {self.port} failed to start") from self._error
            if time.monotonic() > deadline:
                raise TimeoutError(f"server on port {self.port} did not start within {timeout}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 15.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
