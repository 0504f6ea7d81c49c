"""``until_disconnected``: the work runs in the request's task, which a watcher cancels when the client
leaves; the task is left uncancelled whatever happened, and a result the work produced anyway is
discarded."""

from __future__ import annotations

import asyncio

import pytest

from proxy.stages.disconnect import ClientDisconnected, until_disconnected


def uncancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0


class Client:
    """An ASGI ``receive``: nothing until ``leave()``, then ``http.disconnect``."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.gone.set()


async def test_finished_work_returns_and_leaves_the_task_uncancelled() -> None:
    client = Client()

    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    assert await until_disconnected(client.receive, work()) == 7
    client.leave()  # a late disconnect touches nothing any more
    await asyncio.sleep(0.01)
    assert uncancelled()


async def test_a_client_leaving_cancels_the_work_and_raises() -> None:
    client = Client()
    cleaned: list[str] = []

    async def work() -> int:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.append("work")
        return 1

    asyncio.get_running_loop().call_later(0.01, client.leave)
    with pytest.raises(ClientDisconnected):
        await until_disconnected(client.receive, work())
    assert cleaned == ["work"]
    assert uncancelled()
    await asyncio.sleep(0)  # no cancellation left pending on the task


async def test_work_that_finishes_anyway_is_discarded() -> None:
    client = Client()
    discarded: list[int] = []

    async def stubborn() -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return 5  # e.g. a stream opened just as the client left
        return 0

    asyncio.get_running_loop().call_later(0.01, client.leave)
    with pytest.raises(ClientDisconnected):
        await until_disconnected(client.receive, stubborn(), discarded.append)
    assert discarded == [5]
    assert uncancelled()
    await asyncio.sleep(0)


async def test_a_cancellation_from_elsewhere_is_not_a_disconnect() -> None:
    client = Client()

    async def request() -> None:
        await until_disconnected(client.receive, asyncio.sleep(30))

    task = asyncio.ensure_future(request())
    await asyncio.sleep(0.01)
    task.cancel()  # the server shutting down
    with pytest.raises(asyncio.CancelledError):
        await task
    client.leave()
    await asyncio.sleep(0.01)
