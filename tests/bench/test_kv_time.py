"""The space-time bound of ``bench/kv_time.py``, on a cell small enough to compute by hand."""

from __future__ import annotations

from typing import Any

from bench.kv_time import cell_bounds, completion_bound


def turn(session: str, sent: float, latency: float, prompt: int, bound_hit: int) -> dict[str, Any]:
    return {
        "session": session,
        "sent_s": sent,
        "latency_s": latency,
        "prompt_tokens": prompt,
        "bound_hit_tokens": bound_hit,
    }


def cell() -> dict[str, Any]:
    """Three sessions sharing a 100-token prompt on a 1,100-token pool (the first to come hits none
    of it); a and b return once, after a gap of 1 s (a) and 4 s (b), to hit 100 shared + 500 private
    tokens. 1,500 prompt tokens in all."""
    turns = [
        turn("a", 0.0, 1.0, 100, 0),
        turn("b", 0.0, 1.0, 100, 100),
        turn("c", 0.0, 1.0, 100, 100),
        turn("a", 2.0, 1.0, 600, 600),  # 1 s after its first answer
        turn("b", 5.0, 1.0, 600, 600),  # 4 s after
    ]
    late_b = [dict(t) for t in turns]
    late_b[4]["sent_s"] = 7.0  # another system saw b's gap longer: the least counts
    return {
        "kv_tokens": 1100,
        "ranks": 1,
        "results": {
            "prefixgate prefix_affinity": {"turns": turns, "hit_rate": 0.8, "wall_s": 9.0},
            "vllm-router consistent_hash": {"turns": late_b, "hit_rate": 0.3, "wall_s": 8.0},
        },
    }


def test_the_shortest_gaps_are_kept_first_over_the_pool_less_the_shared_prompt() -> None:
    # the shared prompt is the median first turn's hit (100); min(hit, 100) over the turns is
    # 0 + 100 + 100 + 100 + 100 = 400 tokens, kept for free
    assert completion_bound(cell(), 400 / 1500) == 0.0
    # 500 more: a's private tokens through its 1 s gap, 500 pool-seconds over 1,000 tokens
    assert completion_bound(cell(), 900 / 1500) == 0.5
    # 250 more still: b's, through 4 s: (500 + 1,000) / 1,000
    assert completion_bound(cell(), 1150 / 1500) == 1.5
    # past every hit the turns could have (1,400)
    assert completion_bound(cell(), 1401 / 1500) is None


def test_each_system_and_the_best_peer_plus_the_margin() -> None:
    bounds = cell_bounds(cell())
    assert bounds["prefixgate prefix_affinity"]["completion_s"] == 9.0
    assert bounds["best peer + margin"]["hit_rate"] == 0.3 + 0.15
    # 0.45 x 1,500 = 675 tokens: 400 shared + 275 of a's through 1 s
    assert abs(bounds["best peer + margin"]["bound_s"] - 0.275) < 1e-9
