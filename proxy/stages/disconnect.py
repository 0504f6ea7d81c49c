"""The client's side of the connection: noticing that it went away, so its work is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its answer was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(
    receive: Receive, work: Awaitable[T], discard: Callable[[T], object] | None = None
) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``.

    ``discard`` releases what ``work`` produced when it finished anyway while being cancelled (an
    upstream stream just opened must still be closed)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        result = await task
    except (asyncio.CancelledError, Exception):
        pass
    else:
        if discard is not None:
            discard(result)
    raise ClientDisconnected()
