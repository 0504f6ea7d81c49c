"""The wait queue serves higher priority first and shares the rest weighted-fair across client keys,
so one key's backlog cannot starve the others; the keys file gives each key its priority and weight."""

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
        def attempt() -> int | None:
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


async def test_only_the_head_looks_for_room_and_a_cancelled_waiter_leaves() -> None:
    queue = WaitQueue(poll_interval=10.0)
    depths: list[int] = []
    head = asyncio.ensure_future(queue.wait(lambda: None, depths.append))
    for _ in range(3):
        await asyncio.sleep(0)
    looked: list[str] = []

    def behind_attempt() -> str:
        looked.append("behind")
        return "room"

    behind = asyncio.ensure_future(queue.wait(behind_attempt, depths.append))
    for _ in range(3):
        await asyncio.sleep(0)
    queue.notify()
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(queue) == 2 and not behind.done() and looked == []  # room is the head's to take first
    head.cancel()  # its client left: it leaves the queue, and the next waiter looks at once
    assert await asyncio.wait_for(behind, 5) == "room" and looked == ["behind"]
    assert len(queue) == 0 and depths[-1] == 0
