"""Running simulated ranks: one uvicorn server per rank, each in a thread with its own event loop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar, cast

import uvicorn

from bench.sim.config import FaultConfig, SimConfig
from bench.sim.connection import expose_connection
from bench.sim.rank import SimRank
from bench.sim.server import build_app

log = logging.getLogger(__name__)
T = TypeVar("T")


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP: asyncio sets TCP_NODELAY on accepted sockets only then (else Nagle + delayed
    # ACK add 40 ms to every response written in two parts).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class SimRankServer:
    """One simulated rank served over HTTP on ``config.host:config.port`` (0 = a free port).

    ``start()`` returns once the rank listens; ``stop()`` shuts it down. Usable as a context manager.
    ``rank`` is the in-process state (pool, engine, counters); mutate or read it from the server's
    own loop with :meth:`call` when requests may be in flight.
    """

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.name = config.name
        self.port = config.port
        self._rank: SimRank | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._protocol_factory: Callable[[], asyncio.Protocol] | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 15.0) -> SimRankServer:
        """Start serving; returns when the port accepts connections."""
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        sock = _listen(self.config.host, self.config.port)
        self.port = sock.getsockname()[1]
        self._thread = threading.Thread(
            target=self._main, args=(sock,), name=f"sim-rank-{self.name}", daemon=True
        )
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"{self.name} did not start within {timeout} s")
        if self._error is not None:
            raise RuntimeError(f"{self.name} failed to start") from self._error
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving (in-flight requests get ~1 s to finish) and release the ports."""
        self.ask_to_stop()
        self.wait_stopped(timeout)

    def ask_to_stop(self) -> None:
        """Tell the server to stop, without waiting for it (``wait_stopped`` waits)."""
        if self._thread is None or self._loop is None:
            return
        loop, server = self._loop, self._uvicorn
        if server is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    def wait_stopped(self, timeout: float = 10.0) -> None:
        """Wait for the server ``ask_to_stop`` stopped to release its ports."""
        if self._thread is None or self._loop is None:
            return
        self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> SimRankServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self, sock: socket.socket) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(sock))
        except BaseException as exc:  # surfaces in start() instead of dying silently in the thread
            self._error = exc
            log.exception("%s crashed", self.name)
        finally:
            self._ready.set()
            loop.close()

    async def _serve(self, sock: socket.socket) -> None:
        rank = SimRank(self.config, self._set_refusing)
        self._rank = rank
        rank.start()
        app = expose_connection(build_app(rank))
        config = uvicorn.Config(
            app,
            log_config=None,  # uvicorn's dictConfig would reconfigure the host process's logging
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
            timeout_keep_alive=cast(Any, self.config.keep_alive_s),  # uvicorn hands it to call_later
        )
        server = uvicorn.Server(config)
        self._uvicorn = server
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.005)
        self._ready.set()
        try:
            await task
        finally:
            await rank.stop()
            sock.close()

    # -- faults --------------------------------------------------------------------------------
    async def _set_refusing(self, refuse: bool) -> None:
        server = self._uvicorn
        assert server is not None
        if refuse:
            for srv in server.servers:
                # CPython's asyncio Server keeps its protocol factory (a private attribute the typeshed
                # stubs do not declare, hence the cast): reused to listen again.
                self._protocol_factory = cast(Any, srv)._protocol_factory
                srv.close()
            server.servers = []
            for conn in list(server.server_state.connections):
                conn.shutdown()  # idle keep-alive connections close now, busy ones after their response
        elif not server.servers and self._protocol_factory is not None:
            sock = _listen(self.config.host, self.port)
            srv = await asyncio.get_running_loop().create_server(self._protocol_factory, sock=sock)
            server.servers = [srv]

    def set_faults(self, **knobs: Any) -> FaultConfig:
        """Change fault knobs at run time (see :class:`FaultConfig`); returns the new knobs."""
        rank = self.rank
        return self._run(rank.faults.update(**knobs))

    def clear_faults(self) -> FaultConfig:
        """Back to no faults."""
        return self.set_faults(**FaultConfig().as_dict())

    # -- access --------------------------------------------------------------------------------
    def _run(self, coro: Any, timeout: float = 10.0) -> Any:
        if self._loop is None:
            raise RuntimeError(f"{self.name} is not running")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def call(self, fn: Callable[[SimRank], T], timeout: float = 10.0) -> T:
        """Run ``fn(rank)`` on the server's loop (no step runs concurrently) and return its result."""

        async def run() -> T:
            return fn(self.rank)

        return self._run(run(), timeout)

    @property
    def rank(self) -> SimRank:
        if self._rank is None:
            raise RuntimeError(f"{self.name} is not started")
        return self._rank

    @property
    def url(self) -> str:
        host = self.config.host
        return f"http://[{host}]:{self.port}" if ":" in host else f"http://{host}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str | None:
        pub = self.rank.publisher
        return pub.endpoint if pub else None

    @property
    def kv_replay_endpoint(self) -> str | None:
        pub = self.rank.publisher
        return pub.replay_endpoint if pub else None


def start_fleet(n: int, base_config: SimConfig | None = None) -> list[SimRankServer]:
    """Start ``n`` ranks named ``sim-0..``; fixed ports in ``base_config`` are offset by the rank index."""
    base = base_config or SimConfig()
    servers: list[SimRankServer] = []
    try:
        for i in range(n):
            cfg = replace(
                base,
                name=f"sim-{i}",
                port=base.port + i if base.port else 0,
                kv_events_port=base.kv_events_port + i if base.kv_events_port else 0,
                kv_replay_port=base.kv_replay_port + i if base.kv_replay_port else 0,
                faults=replace(base.faults),
            )
            servers.append(SimRankServer(cfg).start())
    except BaseException:
        for s in servers:
            s.stop()
        raise
    if base.cpu_tier_tokens:
        engines = [s.rank.engine for s in servers]
        for engine in engines:
            engine.peers = engines
    return servers


def stop_fleet(servers: list[SimRankServer]) -> None:
    """Stop every server of a fleet: all told at once, then waited for (each takes up to a tick of
    uvicorn's main loop, 0.1-0.2 s, to notice: one after the other, a demo's 20 stops took 3.5 s)."""
    for s in servers:
        s.ask_to_stop()
    for s in servers:
        s.wait_stopped()
