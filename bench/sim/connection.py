"""The client's connection as a handler sees it: drop it as a dying rank would, notice it leaving."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from bench.sim.faults import DropConnection
from bench.sim.scheduler import Engine
from bench.sim.sequences import OutQueue, SimRequest

_SEND_KEY = "prefixgate.sim.send"


def expose_connection(app: ASGIApp) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """Wrap an ASGI app so that handlers can drop their connection (:func:`drop_connection`)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[_SEND_KEY] = send
        await app(scope, receive, send)

    return wrapped


async def drop_connection(scope: Scope) -> None:
    """Close the client's connection abruptly, after what was already sent, as a dying rank would.

    The transport comes from uvicorn's per-request ``send`` (see :func:`expose_connection`). Waiting
    for the write buffer keeps the chunks already yielded; ``abort`` then drops the unsent rest (the
    end of the chunked body included) and marks the connection lost so nothing more is written.
    """
    send = scope.get(_SEND_KEY)
    transport: Any = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise DropConnection("no transport to drop: run the app through expose_connection and uvicorn")
    for _ in range(2000):
        if transport.is_closing() or transport.get_write_buffer_size() == 0:
            break
        await asyncio.sleep(0.001)
    transport.abort()
    # Let connection_lost run: uvicorn then ignores the rest of the response instead of sending a 500.
    for _ in range(3):
        await asyncio.sleep(0)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_finished(request: Request, engine: Engine, reqs: list[SimRequest], out: OutQueue) -> bool:
    """Wait until every sequence of ``reqs`` finished or the client went away; True when all finished.

    Either way the sequences are aborted afterwards (a no-op for finished ones), so a departed client's
    blocks are freed.
    """

    async def collect() -> None:
        pending = len(reqs)
        while pending:
            _, _, finish = await out.get()
            if finish is not None:
                pending -= 1

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait([collector, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        collector.cancel()
        watcher.cancel()
        engine.abort(reqs)
    return all(r.finish_reason for r in reqs)
