"""Real-vLLM report: per turn of an agent session, what the rank reported as cached vs what was estimated.

Runs prefixgate (``prefix_affinity``, ``hf`` tokenization of the tiny model) in front of two real
vLLM CPU ranks, once per index mode, each with a fresh session:

- ``history``: the prefix index records the blocks of every prompt routed to a rank;
- ``kv_events``: the index mirrors the ranks' KV-cache events (exact);
- ``kv_events, no pause``: the same, turns sent back to back (no agent think time);

plus a plain per-rank mirror built here from the tokenizer (``SimpleMirror``), as a check of the
estimate's arithmetic. Prints a table and writes ``bench/out/real_vllm.json``.

``python -m bench.real_vllm.report [--turns 8]`` (starts two ranks, about a minute; or reuses running
ones when ``PREFIXGATE_VLLM_RANKS`` names a state file of ``python -m bench.real_vllm.ranks --state``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from bench.real_vllm.ranks import ATTACH_ENV, HASH_SEED, attach_ranks, ensure_model, start_ranks, stop_ranks
from bench.real_vllm.session import SimpleMirror, agent_turns, chat, gateway_settings
from proxy.app import create_app
from proxy.server import ServerThread
from tokenization.base import ChatPrompt
from tokenization.block_hash import BlockHasher
from tokenization.hf_tokenizer import HfTokenizer

OUT = Path(__file__).resolve().parents[1] / "out" / "real_vllm.json"
BLOCK = 32
MODES: tuple[tuple[str, bool, float], ...] = (
    ("history", False, 0.2),
    ("kv_events", True, 0.2),
    ("kv_events, no pause", True, 0.0),
)


def run_mode(
    ranks: list[Any], model_dir: Path, kv_events: bool, think_s: float, turns: int
) -> list[dict[str, Any]]:
    """One fresh session through a fresh prefixgate; per turn, reported vs estimated cached tokens."""
    settings = gateway_settings(ranks, model_dir, kv_events=kv_events)
    tok = HfTokenizer(model_dir)
    hasher = BlockHasher(BLOCK, "sha256", seed=HASH_SEED)
    mirror = SimpleMirror()
    nonce = uuid.uuid4().hex[:12]
    rows = []
    with (
        ServerThread(create_app(settings)) as gw,
        httpx.Client(trust_env=False, timeout=120.0) as client,
    ):
        for turn, (messages, tools) in enumerate(agent_turns(nonce, turns)):
            result = chat(client, gw.url, messages, tools, session=nonce)
            tokens = list(tok.encode_chat(ChatPrompt(messages, tools)).tokens)
            hashes = hasher.hash_blocks(tokens)
            rank = result.rank or "?"
            simple = mirror.estimate(rank, hashes, len(tokens), BLOCK)
            mirror.record(rank, hashes)
            rows.append(
                {
                    "turn": turn,
                    "backend": rank,
                    "prompt_tokens": result.prompt_tokens,
                    "cached_tokens": result.cached_tokens,
                    "estimated": result.estimated,
                    "simple_mirror": simple,
                }
            )
            time.sleep(think_s)
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs((r["estimated"] or 0) - r["cached_tokens"]) for r in rows]
    return {
        "turns": len(rows),
        "exact_turns": sum(1 for e in errors if e == 0),
        "mean_abs_error_tokens": sum(errors) / len(rows),
        "max_abs_error_tokens": max(errors),
        "reported_cached_tokens": sum(r["cached_tokens"] for r in rows),
        "estimated_cached_tokens": sum(r["estimated"] or 0 for r in rows),
        "ranks_used": sorted({r["backend"] for r in rows}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="sessions per mode (fresh each)")
    args = parser.parse_args(argv)
    model_dir = ensure_model()
    attach = os.environ.get(ATTACH_ENV)
    ranks = attach_ranks(Path(attach)) if attach else start_ranks(2, model_dir=model_dir)
    try:
        results: dict[str, Any] = {}
        for name, kv_events, think_s in MODES:
            sessions = [
                run_mode(ranks, model_dir, kv_events, think_s, args.turns) for _ in range(args.rounds)
            ]
            flat = [row for s in sessions for row in s]
            results[name] = {"think_s": think_s, "summary": summarize(flat), "sessions": sessions}
    finally:
        if not attach:
            stop_ranks(ranks)
    first = {name: r["sessions"][0] for name, r in results.items()}
    print(f"{'turn':>4} " + " ".join(f"{name + ' (reported/est.)':>34}" for name in first))
    for t in range(args.turns):
        cells = [f"{s[t]['cached_tokens']:>6} / {s[t]['estimated']!s:>6}" for s in first.values()]
        print(f"{t:>4} " + " ".join(f"{c:>34}" for c in cells))
    for name, r in results.items():
        print(f"{name}: {json.dumps(r['summary'])}")
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"block_size": BLOCK, "modes": results}, indent=1), encoding="utf-8")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
