"""``bench/moves.py`` reads the move lines the router logs, so its rules must match the words the
router writes: the lines here come from real moves routed by ``Router``."""

from __future__ import annotations

import logging

import pytest

from bench.moves import moves
from tests.routing.test_home import down_home_turn, homed_turn, overloaded_home


def test_moves_are_counted_by_the_rule_the_router_names(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="prefixgate.route"):
        router, turn, home, _ = overloaded_home("s", 20, 50_000)  # an unknown pool: over the bound
        assert homed_turn(router, "s", turn, home) != home
        home, moved = down_home_turn("d")
        assert moved != home
    assert moves([caplog.text, "unrelated line\n"]) == {
        "home saturated": {"moves": 1, "sessions": 1},
        "rank down or failed": {"moves": 1, "sessions": 1},
    }
    assert moves([caplog.text, caplog.text])["home saturated"] == {"moves": 2, "sessions": 1}
