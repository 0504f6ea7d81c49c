"""Real-vLLM siblings: waves of an agent's sessions sent back to back, estimates against the ranks'.

Each wave is a fresh prefixgate (``prefix_affinity``, ``hf`` tokenization, KV events from both
ranks) and one agent's ``--sessions`` sessions, interleaved as concurrent agents arrive: turn t of
every session back to back, a short think, then turn t + 1. The sessions share their first block
(the agent's head), so each one sent right after another is routed before that one's KV events can
have arrived. Per wave and in all: the turns whose estimated cached tokens differ from what the rank
reported (first turns and later ones apart), the prefill the ranks did, and how many waves spread
their sessions over both ranks. Writes ``bench/out/real_vllm_siblings.json``.

``python -m bench.real_vllm.siblings [--waves 30]`` (starts two ranks; or reuses running ones when
``PREFIXGATE_VLLM_RANKS`` names a state file of ``python -m bench.real_vllm.ranks --state``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from bench.real_vllm.ranks import ATTACH_ENV, attach_ranks, ensure_model, start_ranks, stop_ranks
from bench.real_vllm.session import TurnResult, agent_turns, chat, gateway_settings
from proxy.app import create_app
from proxy.server import ServerThread

OUT = Path(__file__).resolve().parents[1] / "out" / "real_vllm_siblings.json"
#: The pause after each round of turns (an agent's think time, short: the race is within a round).
THINK_S = 0.2


def run_wave(ranks: list[Any], model_dir: Path, sessions: int, turns: int) -> dict[str, list[TurnResult]]:
    """One wave through a fresh prefixgate: every session's turns, as served."""
    settings = gateway_settings(ranks, model_dir, kv_events=True)
    nonce = uuid.uuid4().hex[:12]
    names = [f"{nonce}-{k}" for k in range(sessions)]
    plans = {s: list(agent_turns(s, turns)) for s in names}
    served: dict[str, list[TurnResult]] = {s: [] for s in names}
    with (
        ServerThread(create_app(settings)) as gw,
        httpx.Client(trust_env=False, timeout=120.0) as client,
    ):
        for t in range(turns):
            for s in names:
                messages, tools = plans[s][t]
                served[s].append(chat(client, gw.url, messages, tools, session=s))
            time.sleep(THINK_S)
    return served


def summarize(waves: list[dict[str, list[TurnResult]]]) -> dict[str, Any]:
    turns = [(t, r) for wave in waves for results in wave.values() for t, r in enumerate(results)]
    wrong = [(t, r) for t, r in turns if r.estimated != r.cached_tokens]
    error = sum(abs((r.estimated or 0) - r.cached_tokens) for _, r in turns)
    return {
        "waves": len(waves),
        "turns": len(turns),
        "mismatched_turns": len(wrong),
        "mismatched_first_turns": sum(1 for t, _ in wrong if t == 0),
        "mismatched_later_turns": sum(1 for t, _ in wrong if t > 0),
        "mean_abs_error_tokens": error / len(turns),
        "prompt_tokens": sum(r.prompt_tokens for _, r in turns),
        "cached_tokens": sum(r.cached_tokens for _, r in turns),
        "prefill_tokens": sum(r.prompt_tokens - r.cached_tokens for _, r in turns),
        "waves_over_both_ranks": sum(
            1 for wave in waves if len({r.rank for results in wave.values() for r in results}) > 1
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=30)
    parser.add_argument("--sessions", type=int, default=4, help="sibling sessions per wave")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    model_dir = ensure_model()
    attach = os.environ.get(ATTACH_ENV)
    ranks = attach_ranks(Path(attach)) if attach else start_ranks(2, model_dir=model_dir)
    try:
        waves = [run_wave(ranks, model_dir, args.sessions, args.turns) for _ in range(args.waves)]
    finally:
        if not attach:
            stop_ranks(ranks)
    summary = summarize(waves)
    for key, value in summary.items():
        print(f"{key:>24}: {value:.1f}" if isinstance(value, float) else f"{key:>24}: {value}")
    rows = [[{"turn": t, **asdict(r)} for t, r in enumerate(rs)] for wave in waves for rs in wave.values()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"summary": summary, "sessions": rows}, indent=1), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
