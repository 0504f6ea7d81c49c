"""Running an ASGI app with uvicorn: in the foreground (``prefixgate serve``) or in a thread.

prefixgate's own app is served with ``ServingOptions`` (from its settings, left on the app's state
by ``proxy.app.create_app``): the client keep-alive, advertised in a ``Keep-Alive: timeout=`` header
so that clients expire their pooled connections first; the guarded protocol of
``proxy/connections.py`` (header and body timeouts, a connection cap); ``X-Forwarded-For`` believed
only from the configured proxies. Any other app (the test ranks) gets uvicorn's defaults.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
import resource
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import uvicorn

from proxy.connections import protocol_factory

if TYPE_CHECKING:
    from proxy.config import Settings

log = logging.getLogger("prefixgate")

#: Descriptors kept aside from the connection cap's share of the open-files limit (logs, Redis, ZMQ).
RESERVED_FDS = 64
#: uvicorn's listen backlog: how many connections may wait to be accepted (and asyncio accepts at once).
DEFAULT_BACKLOG = 2048
#: glibc's mallopt parameters (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: Allocations from this size up get their own pages, returned to the system when freed. Not lower:
#: orjson's parse takes a scratch buffer of ~12 times the body (over 4 MiB for a 100k-token prompt's
#: 400 KB), and at the 256 KiB this was, that buffer and every body-sized copy were mapped afresh
#: for each request: ~500 page faults and ~1 ms of system time per 100k-token request.
MMAP_THRESHOLD = 16 * 1024 * 1024
#: A client that leaves with at least this much of its body read: the heap's free pages go back at once.
TRIM_AFTER_BYTES = 1024 * 1024
#: The cyclic garbage collector's thresholds in ``prefixgate serve`` (CPython's default: 700, 10, 10).
#: A request in flight holds its parsed body, its tasks and its connections' parsers for as long as
#: the rank takes, so with the default young threshold most of them outlive two young collections and
#: land in the oldest generation, whose full collections walk every session's cached turn: at 1,000
#: streaming sessions (the load investigation, docs/investigations.md) full collections came every
#: 0.8 s, ~190 ms each,
#: a third of the process's CPU. With 10,000 allocations between young collections far fewer in-flight
#: objects are promoted (one full collection in 30 s), and the middle generation, collected every
#: 200,000 allocations, still frees reference cycles (an exception's traceback holding a body) within
#: a few hundred requests.
COLLECTOR_THRESHOLDS = (10_000, 20, 10)


@dataclass(frozen=True, slots=True)
class ServingOptions:
    """How prefixgate serves its clients: the connection settings of ``Settings``."""

    keepalive: float = 75.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    #: 0: what fits in the open-files limit with a connection to a rank for each (``limits``).
    max_connections: int = 0
    trusted_proxies: str | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> ServingOptions:
        return cls(
            settings.client_keepalive,
            settings.header_timeout,
            settings.body_timeout,
            settings.max_connections,
            settings.trusted_proxies,
        )

    def limits(self) -> tuple[int, int]:
        """The connection cap and the listen backlog, within the open-files limit.

        asyncio accepts up to a backlog's worth of connections at once before any of them is
        counted, and each client connection may hold one to a rank: the cap, the burst and the
        connections to the ranks must fit together, else accept() fails with EMFILE, which
        Python 3.11's loop logs once for every connection it then tries to accept.
        """
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        files = 1 << 20 if soft == resource.RLIM_INFINITY else soft
        backlog = min(DEFAULT_BACKLOG, max(16, (files - RESERVED_FDS) // 4))
        fitting = max(16, (files - RESERVED_FDS - backlog) // 2)
        return (self.max_connections or fitting), backlog


def prepare_process() -> None:
    """Process-wide set-up of ``prefixgate serve``: the open-files limit raised to its hard limit
    (every client connection and every connection to a rank is a descriptor), and freed request
    bodies handed back to the system."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return_freed_memory()


def tune_collector() -> None:
    """Set ``COLLECTOR_THRESHOLDS`` and move every object alive now (the modules, the app just built)
    to the collector's permanent generation, which no collection walks again: call once the app is
    built, just before it serves. Process-wide: for a serving process, never for one that hosts tests."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*COLLECTOR_THRESHOLDS)


def return_freed_memory() -> None:
    """Make glibc give large freed blocks back to the system at once.

    By default glibc raises its mmap threshold each time a large block is freed (up to 32 MB), so
    after one big request body every later one is carved from the heap, which keeps its pages:
    25 unfinished 30 MB bodies left 790 MB resident after their clients had gone. A fixed threshold
    (setting it turns the adjustment off) keeps every buffer from ``MMAP_THRESHOLD`` up in pages of
    its own; smaller bodies live on the heap, reused by the next requests, and what an unfinished
    one held goes back when its client leaves (``trim_heap``).
    """
    libc = _glibc()
    if libc is None:
        return
    libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    libc.mallopt(M_TRIM_THRESHOLD, 2 * MMAP_THRESHOLD)


def trim_heap() -> None:
    """Hand the heap's free pages back to the system now (glibc's ``malloc_trim``): after a client
    left with a large body half-read, whose buffer the heap would otherwise keep resident."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


@functools.cache
def _glibc() -> Any:
    """glibc, or None when the C library is another (musl, macOS): nothing to tune then."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both must exist)
    except (OSError, AttributeError):
        return None
    return libc


def listen(
    host: str, port: int, *, reuse_port: bool = False, kind: type[socket.socket] = socket.socket
) -> socket.socket:
    """The bound listening socket uvicorn serves on: bound here, so a port in use is told plainly
    (uvicorn would log an ``[Errno 98]`` line and exit 1). ``reuse_port``: with ``SO_REUSEPORT``, so
    that every worker of ``--workers`` binds a socket of its own to the port; ``kind``: the class
    of socket to make."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto says TCP
    # (they inherit the listener's); without it each response's last write waited ~40 ms for the
    # client's delayed ACK (Nagle).
    sock = kind(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


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
    serving: ServingOptions | None = None,
    *,
    graceful_shutdown: float = 10.0,
) -> uvicorn.Config:
    """The serving config of ``prefixgate serve`` (and of ``ServerThread``); ``serving``: prefixgate's
    connection settings (None: uvicorn's defaults, for other apps). ``graceful_shutdown``: on SIGTERM
    uvicorn stops listening and lets in-flight requests (streams too) finish this long, then cancels
    them and runs the app's shutdown."""
    options: dict[str, Any] = {"http": "httptools"}
    if serving is not None:
        cap, backlog = serving.limits()
        options = {
            "http": protocol_factory(serving.header_timeout, serving.body_timeout, cap),
            "backlog": backlog,
            # uvicorn hands it to call_later: a float works where it annotates an int
            "timeout_keep_alive": serving.keepalive,
            "headers": [("keep-alive", f"timeout={int(serving.keepalive)}")],
            "proxy_headers": bool(serving.trusted_proxies),
            "forwarded_allow_ips": serving.trusted_proxies or None,
        }
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
        access_log=False,
        # (uvicorn annotates it int; it is seconds handed to asyncio.wait_for, so a float works)
        timeout_graceful_shutdown=cast(Any, graceful_shutdown),
        lifespan="on",
        **options,
    )


def serving_options(app: Any) -> ServingOptions | None:
    """The ``ServingOptions`` prefixgate's app carries (``create_app``), None for any other app."""
    return getattr(getattr(app, "state", None), "serving", None)


class ServerThread:
    """An ASGI app served by uvicorn on its own event loop in a background thread.

    ``start()`` returns once the server listens; ``stop()`` shuts it down gracefully.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn_config(app, self.host, self.port, log_level, serving=serving_options(app))
        self.server = uvicorn.Server(config)
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
