"""The client's side of the connection: noticing that it went away, so its work is cancelled."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.types import Receive

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before its answer was complete."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(receive: Receive, task: asyncio.Task[Any]) -> bool:
    """Cancel ``task`` when the client disconnects (run as a task of its own beside it)."""
    await wait_for_disconnect(receive)
    task.cancel()
    return True


async def until_disconnected(
    receive: Receive, work: Awaitable[T], discard: Callable[[T], object] | None = None
) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``.

    ``work`` runs in the request's own task, which a watcher cancels when the client leaves: one task
    a request rather than a task for the work too and an ``asyncio.wait`` over both (~6 % of the CPU
    of a small request, py-spy, issue 22). ``discard`` releases what ``work`` produced when it
    finished anyway while being cancelled (an upstream stream just opened must still be closed)."""
    current = asyncio.current_task()
    assert current is not None, "until_disconnected runs in a task"
    watcher = asyncio.ensure_future(cancel_on_disconnect(receive, current))
    try:
        result = await work
    except asyncio.CancelledError:
        if not fired(watcher):
            watcher.cancel()
            raise  # cancelled from elsewhere (the server shutting down): not the client leaving
        current.uncancel()
        raise ClientDisconnected() from None
    if not fired(watcher):
        watcher.cancel()
        return result
    # the client left, but the work absorbed the cancellation and finished anyway
    current.uncancel()
    if discard is not None:
        discard(result)
    raise ClientDisconnected()


def fired(watcher: asyncio.Task[bool] | None) -> bool:
    """Whether the watcher saw the client leave (and so cancelled the request's task)."""
    return watcher is not None and watcher.done() and not watcher.cancelled() and watcher.exception() is None
