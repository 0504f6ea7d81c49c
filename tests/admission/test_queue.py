"""The wait queue serves higher priority first and shares the rest weighted-fair across client keys,
so one key's backlog cannot starve the others; the keys file gives each key its priority and weight.
Waiters look for room in that order, so one behind takes only room those ahead of it cannot use."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from proxy.admission.queue import Ticket, WaitQueue
from proxy.config import ConfigError
from proxy.ops.auth import read_keys_file


async def serve_in_order(tickets: list[Ticket]) -> list[int]:
    """Queue one waiter per ticket (in list order), then free one room at a time; the order served."""
    queue = WaitQueue(poll_interval=10.0)
    rooms = 0
    served: list[int] = []

    def attempt_for(index: int):  # type: ignore[no-untyped-def]
        def attempt(first: bool) -> int | None:
            nonlocal rooms
            if rooms <= 0:
                return None
            rooms -= 1
            return index

        return attempt

    waiters = [
        asyncio.ensure_future(queue.wait(attempt_for(i), lambda depth: None, ticket))
        for i, ticket in enumerate(tickets)
    ]
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(queue) == len(tickets)
    for _ in tickets:
        rooms += 1
        queue.notify()
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            served.append(task.result())
            waiters.remove(task)
    return served


async def test_higher_priority_is_served_first_then_first_come() -> None:
    order = await serve_in_order([Ticket("a"), Ticket("b", priority=5), Ticket("a"), Ticket("c", priority=5)])
    assert order == [1, 3, 0, 2]


async def test_one_keys_backlog_does_not_starve_another_key() -> None:
    # a queued five before b arrived: b's one waiter goes second, not sixth
    order = await serve_in_order([Ticket("a")] * 5 + [Ticket("b")])
    assert order[:2] == [0, 5]
    assert order[2:] == [1, 2, 3, 4]


async def test_weights_share_the_room_that_frees() -> None:
    # b weighs 3: of the first four rooms, a gets one and b three
    order = await serve_in_order([Ticket("a")] * 4 + [Ticket("b", weight=3.0)] * 4)
    assert sorted(order[:4]) == [0, 4, 5, 6]


def test_the_keys_file_gives_priority_and_weight(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "- {key: k-batch, label: batch, priority: -1, weight: 0.5}\n"
        "- {key: k-ide, label: ide, priority: 10, weight: 4, max_sessions: 3}\n"
        "- {key: k-plain, label: plain}\n"
    )
    batch, ide, plain = read_keys_file(keys)
    assert (batch.priority, batch.weight) == (-1, 0.5)
    assert (ide.priority, ide.weight, ide.max_sessions) == (10, 4.0, 3)
    assert (plain.priority, plain.weight) == (0, 1.0)
    for bad in ("priority: high", "weight: 0", "weight: -2", "priority: true"):
        keys.write_text(f"- {{key: k, label: l, {bad}}}\n")
        with pytest.raises(ConfigError):
            read_keys_file(keys)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_waiters_look_in_order_and_one_behind_takes_room_the_head_cannot_use() -> None:
    queue = WaitQueue(poll_interval=10.0)
    free = 0  # units of room; the head needs 2, the one behind it 1
    looked: list[tuple[str, bool]] = []

    def attempt_for(name: str, need: int):  # type: ignore[no-untyped-def]
        def attempt(first: bool) -> str | None:
            nonlocal free
            looked.append((name, first))
            if free < need:
                return None
            free -= need
            return name

        return attempt

    depths: list[int] = []
    head = asyncio.ensure_future(queue.wait(attempt_for("large", 2), depths.append))
    await settle()
    behind = asyncio.ensure_future(queue.wait(attempt_for("small", 1), depths.append))
    await settle()
    looked.clear()
    free = 1
    queue.notify()
    await settle()
    # the head looked first and could not use the room; the one behind it took it
    assert looked[:2] == [("large", True), ("small", False)]
    assert behind.done() and behind.result() == "small" and not head.done() and free == 0
    looked.clear()
    free = 2
    queue.notify()
    assert await asyncio.wait_for(head, 5) == "large" and looked == [("large", True)]
    assert len(queue) == 0 and depths[-1] == 0


async def test_a_waiter_behind_never_takes_room_the_head_can_use() -> None:
    queue = WaitQueue(poll_interval=10.0)
    free = 0

    def attempt(first: bool) -> str | None:
        nonlocal free
        if free < 1:
            return None
        free -= 1
        return "first" if first else "behind"

    tasks = [asyncio.ensure_future(queue.wait(attempt, lambda depth: None)) for _ in range(2)]
    await settle()
    free = 1
    queue.notify()
    await settle()
    assert [t.result() if t.done() else None for t in tasks] == ["first", None]
    tasks[1].cancel()
    await settle()
    assert len(queue) == 0


async def test_a_cancelled_waiter_leaves_and_the_next_becomes_first() -> None:
    queue = WaitQueue(poll_interval=10.0)
    looked: list[bool] = []
    head = asyncio.ensure_future(queue.wait(lambda first: None, lambda depth: None))
    await settle()

    def behind_attempt(first: bool) -> str | None:
        looked.append(first)
        return "room" if first else None  # only the first may rotate a seat to itself

    behind = asyncio.ensure_future(queue.wait(behind_attempt, lambda depth: None))
    await settle()
    assert looked == [False] and not behind.done()
    head.cancel()  # its client left: it leaves the queue, and the next waiter looks at once, first
    assert await asyncio.wait_for(behind, 5) == "room" and looked[-1] is True
    assert len(queue) == 0


async def test_a_seat_found_for_a_waiter_that_left_is_given_back() -> None:
    queue = WaitQueue(poll_interval=10.0)
    free = 0
    abandoned: list[str] = []

    def attempt(first: bool) -> str | None:
        return "seat" if free else None

    waiter = asyncio.ensure_future(queue.wait(attempt, lambda depth: None, abandoned=abandoned.append))
    await settle()
    waiter.cancel()  # its client leaves; before its task resumes to see that,
    free = 1
    queue.notify()
    queue._pass()  # another waiter's task runs a pass, which finds it a seat
    await settle()
    assert waiter.cancelled() and abandoned == ["seat"] and len(queue) == 0


async def test_a_waiter_that_looked_alone_is_not_asked_again_until_something_changes() -> None:
    queue = WaitQueue(poll_interval=10.0)
    free = 0
    looks: list[bool] = []

    def attempt(first: bool) -> str | None:
        looks.append(first)
        return "seat" if free else None

    assert attempt(True) is None  # the gate's own look, made before it joined the empty queue
    waiter = asyncio.ensure_future(queue.wait(attempt, lambda depth: None, looked=True))
    await settle()
    assert looks == [True] and not waiter.done(), "its look counted for this change: not made twice"
    free = 1
    queue.notify()  # room freed: it looks again, first
    assert await asyncio.wait_for(waiter, 5) == "seat" and looks == [True, True]


async def test_a_waiter_that_did_not_look_looks_as_it_joins() -> None:
    queue = WaitQueue(poll_interval=10.0)
    looks: list[bool] = []

    def attempt(first: bool) -> str | None:
        looks.append(first)
        return "seat"

    assert await asyncio.wait_for(queue.wait(attempt, lambda depth: None), 5) == "seat"
    assert looks == [True]
