"""Cost of ``Canonicalizer.apply`` on a ~100k-token agent request (target: <= 0.5 ms median).

Request: a Claude Code-shaped body (billing line, <env> with a date, ~3k-token system prompt), 15 tools
with nested schemas, and ~300 history messages (user / assistant tool calls / tool results) for about
100k tokens. Measured:

- ``first turn``: a new session whose system text and tools were never seen (cache misses);
- ``repeat turn``: the same session on its next turn (same system and tools, re-parsed from JSON as a
  server would, so string objects are new and hashes are recomputed);
- ``parse only``: orjson.loads of the same body, for scale.

Run: ``python bench/canonical_cost.py [--runs N]``. Prints a table, writes bench/out/canonical_cost.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from typing import Any

import orjson

from bench.common import write_json
from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from tokenization.encoding import encode

_SENTENCES = (
    "the request handler reads the config file and retries the upstream call with backoff while the",
    "cache keeps the session state in memory and the tests cover each branch of the parser",
)
_WORDS = tuple(" ".join(_SENTENCES).split())


def _prose(seed: int, words: int) -> str:
    return " ".join(_WORDS[(seed * 7 + i * 13) % len(_WORDS)] for i in range(words))


def build_request(n_turns: int = 100) -> dict[str, Any]:
    """A deterministic ~100k-token chat request with the volatile fields of a real agent."""
    system = [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=2.1.30.4c1; cc_entrypoint=cli; cch=5d21e;",
        },
        {"type": "text", "text": "\n\n".join(_prose(i, 120) for i in range(18))},
        {
            "type": "text",
            "text": "Here is useful information about the environment:\n<env>\nWorking directory: /srv/app\n"
            "Platform: linux\nToday's date: 2025-11-03\n</env>",
        },
    ]
    tools = []
    for t in range(15):
        props: dict[str, dict[str, Any]] = {
            f"arg{j}": {"type": "string", "description": _prose(t * 10 + j, 25), "enum": ["a", "b"]}
            for j in range(6)
        }
        props["opts"] = {"type": "object", "properties": {"depth": {"type": "integer", "minimum": 0}}}
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{t:02d}",
                    "description": _prose(t, 140),
                    "parameters": {"type": "object", "properties": props, "required": ["arg0"]},
                },
            }
        )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": _prose(1, 60)},
    ]
    for i in range(n_turns):
        call_id = f"call_{i}"
        messages.append(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "tool_01", "arguments": '{"arg0": "x"}'},
                    }
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": _prose(i, 850)})
        messages.append({"role": "user", "content": _prose(i + 3, 20)})
    return {"model": "m", "messages": messages, "tools": tools, "stream": True}


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p99_ms": ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--turns", type=int, default=100, help="history turns (3 messages each)")
    args = parser.parse_args(argv)

    body = build_request(args.turns)
    raw = orjson.dumps(body)
    text = "".join(
        (m["content"] if isinstance(m["content"], str) else json.dumps(m["content"]))
        if m.get("content")
        else ""
        for m in body["messages"]
    )
    tokens = len(encode(text + json.dumps(body["tools"])))
    config = CanonicalConfig()
    bodies = [orjson.loads(raw) for _ in range(args.runs)]  # parsed up front: not part of the timing

    # First turn: system text and tools never seen before (a unique word in each), warm process.
    canon = Canonicalizer(config)
    canon.apply(orjson.loads(raw), api="chat", model="m")
    for n, b in enumerate(bodies):
        b["messages"][0]["content"][1]["text"] += f" run{n}"
        b["tools"][3]["function"]["description"] += f" run{n}"
    first: list[float] = []
    gc.collect()  # start each timed loop from a clean heap: the bodies above are large
    for b in bodies:
        state = InMemorySessionCanonState()
        t0 = time.perf_counter()
        canon.apply(b, api="chat", session=state, model="m")
        first.append(time.perf_counter() - t0)

    canon = Canonicalizer(config)
    state = InMemorySessionCanonState()
    result = canon.apply(orjson.loads(raw), api="chat", session=state, model="m")
    repeat: list[float] = []
    repeated = [orjson.loads(raw) for _ in range(args.runs)]
    gc.collect()
    for b in repeated:
        t0 = time.perf_counter()
        canon.apply(b, api="chat", session=state, model="m")
        repeat.append(time.perf_counter() - t0)

    parse: list[float] = []
    for _ in range(min(args.runs, 100)):
        t0 = time.perf_counter()
        orjson.loads(raw)
        parse.append(time.perf_counter() - t0)

    report = {
        "request": {
            "bytes": len(raw),
            "tokens": tokens,
            "messages": len(body["messages"]),
            "tools": len(body["tools"]),
            "rewrites": result.rewrites,
        },
        "runs": args.runs,
        "first_turn": _stats(first),
        "repeat_turn": _stats(repeat),
        "parse_only": _stats(parse),
        "target_median_ms": 0.5,
    }
    print(
        f"request: {len(raw) / 1e3:.0f} kB, {tokens:,} tokens, {len(body['messages'])} messages, "
        f"{len(body['tools'])} tools; rewrites {result.rewrites}"
    )
    print(f"{'case':<14}{'median ms':>11}{'p99 ms':>9}{'mean ms':>9}")
    for name in ("first_turn", "repeat_turn", "parse_only"):
        s = report[name]
        print(f"{name:<14}{s['median_ms']:>11.3f}{s['p99_ms']:>9.3f}{s['mean_ms']:>9.3f}")
    print(f"target: repeat-turn median <= {report['target_median_ms']} ms")
    print(f"wrote {write_json('canonical_cost.json', report)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
