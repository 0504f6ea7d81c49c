"""``growing_conversation(reminder=...)``: each turn drops the reminder its previous turn ended with,
the edit ``bench.pipeline_cost``'s ``edited`` workload measures."""

from __future__ import annotations

import orjson

from bench.pipeline_cost import REMINDER
from bench.side_by_side import growing_conversation


def test_each_turn_drops_the_reminder_the_previous_one_ended_with():
    bodies = [orjson.loads(b) for b in growing_conversation(5_000, 500, 3, seed=1, reminder=REMINDER)]
    for turn, body in enumerate(bodies):
        users = [m for m in body["messages"] if m["role"] == "user"]
        assert users[-1]["content"].endswith(REMINDER)
        assert not any(m["content"].endswith(REMINDER) for m in users[:-1])
        if turn:  # the previous turn's newest message, now without its reminder
            before = [m for m in bodies[turn - 1]["messages"] if m["role"] == "user"][-1]["content"]
            assert users[-2]["content"] == before.removesuffix(REMINDER) != before
