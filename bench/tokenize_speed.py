"""Tokenization speed: an appended agent turn (render + tokenize + hash, incremental) vs from scratch.

The conversation takes a real Claude Code trace's shape from ../shared/traces/claude-code (system
and tool token counts, the first request of >= ~100k input tokens, and the growth of the 20
requests after it); its text is generated deterministically, never copied from the trace. Without
the traces folder a synthetic shape is used (and said so).

    python -m bench.tokenize_speed [--turns 20] [--algos xxh3,sha256] [--trace PATH] [--turn-tokens 2000]

Prints a table and writes bench/out/tokenize_speed.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import itertools
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenization.encoding import chatml_encoding, encode
from tokenization.hashers import make_hasher
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "traces" / "claude-code"
OUT_DIR = ROOT / "bench" / "out"
FIRST_TURN_TOKENS = 100_000
TURN_TOKENS = 2_000


@dataclass
class Shape:
    source: str
    system_tokens: int
    tool_tokens: int
    first_turn_tokens: int
    appended: list[int]  # tokens added by each later turn


def trace_shape(turns: int, path: Path | None) -> Shape:
    """System/tool sizes and per-turn growth from a real trace, or a synthetic shape."""
    files = [path] if path else sorted(TRACES.glob("*.json.gz")) if TRACES.is_dir() else []
    for file in files:
        with gzip.open(file) as fh:
            data = json.loads(fh.read())
        ins = [r["in"] for r in data.get("requests", []) if isinstance(r.get("in"), int)]
        for i, n in enumerate(ins):
            if n < FIRST_TURN_TOKENS * 0.95:
                continue
            window = ins[i : i + turns + 1]
            deltas = [b - a for a, b in itertools.pairwise(window)]
            # Take a stretch where every turn extends the previous one by a typical agent step.
            if len(deltas) == turns and all(100 <= d <= 8_000 for d in deltas):
                return Shape(
                    f"{file.name} requests {i}..{i + turns}",
                    data.get("system_tokens") or 3000,
                    data.get("tool_tokens") or 12000,
                    n,
                    deltas,
                )
            break
    print("note: no usable Claude Code trace found; using a synthetic shape", file=sys.stderr)
    return Shape("synthetic", 3000, 12000, FIRST_TURN_TOKENS, [TURN_TOKENS] * turns)


class TextMaker:
    """Deterministic code-and-prose-like text of about a requested token count."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        # Words that are single cl100k tokens, like most words of real code and prose: random
        # letter strings would cost the BPE several merges per word, which real agent text does not.
        vocab = chatml_encoding()
        words = (vocab.decode([t]).strip() for t in range(2_000, 40_000))
        self.words = sorted({w for w in words if w.isascii() and w.isalpha() and 3 <= len(w) <= 12})
        sample = self._raw(40_000)
        self.chars_per_token = len(sample) / len(encode(sample))

    def _raw(self, chars: int) -> str:
        rng, words, out, size = self.rng, self.words, [], 0
        while size < chars:
            line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12)))
            line = (
                rng.choice(["    ", "", "# ", "  - ", "def "])
                + line
                + rng.choice([":", ".", "()", " = 1", ""])
            )
            out.append(line)
            size += len(line) + 1
        return "\n".join(out)

    def text(self, tokens: int) -> str:
        return self._raw(int(tokens * self.chars_per_token))


def build_conversation(shape: Shape, maker: TextMaker) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """The first request body and the messages each later turn appends."""
    n_tools = 20
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": maker.text(shape.tool_tokens // n_tools),
                "parameters": {"type": "object", "properties": {"arg": {"type": "string"}}},
            },
        }
        for i in range(n_tools)
    ]
    messages: list[dict[str, Any]] = [{"role": "system", "content": maker.text(shape.system_tokens)}]
    history = max(0, shape.first_turn_tokens - shape.system_tokens - shape.tool_tokens)
    step = 0
    while history > 0:
        messages.extend(agent_step(maker, min(history, 1500), step))
        history -= 1500
        step += 1
    turns = [agent_step(maker, n, step + k) for k, n in enumerate(shape.appended)]
    return {"model": "sim", "messages": messages, "tools": tools}, turns


def agent_step(maker: TextMaker, tokens: int, k: int) -> list[dict[str, Any]]:
    """An assistant tool call and its result, about ``tokens`` tokens together."""
    call = {
        "id": f"call_{k}",
        "type": "function",
        "function": {"name": "tool_1", "arguments": json.dumps({"arg": f"f{k}.py"})},
    }
    return [
        {"role": "assistant", "content": maker.text(min(60, tokens // 10)), "tool_calls": [call]},
        {"role": "tool", "tool_call_id": f"call_{k}", "content": maker.text(max(1, tokens - 80))},
    ]


async def measure(
    algo: str, first: dict[str, Any], turns: list[list[dict[str, Any]]], block_size: int
) -> dict[str, Any]:
    """One session's appended turns back to back (as its requests arrive), then the same turns each
    right after a from-scratch pass over the whole conversation (CPU caches and allocator cold, as
    when other sessions' work runs in between), and the from-scratch cost of every turn."""
    tok = TiktokenTokenizer()
    bodies, messages = [], list(first["messages"])
    for added in turns:
        messages += added
        bodies.append({**first, "messages": list(messages)})

    inc = IncrementalTokenizer(tok, make_hasher(algo, block_size, "0"))
    t0 = time.perf_counter()
    blocks = await inc.blocks_for_chat("s", first)
    first_ms = (time.perf_counter() - t0) * 1000
    first_tokens = blocks.num_tokens
    appended_ms, appended_tokens, incremental = [], [], []
    for body in bodies:
        before = blocks.num_tokens
        t0 = time.perf_counter()
        blocks = await inc.blocks_for_chat("s", body)
        appended_ms.append((time.perf_counter() - t0) * 1000)
        appended_tokens.append(blocks.num_tokens - before)
        incremental.append(blocks.block_hashes)

    scratch = IncrementalTokenizer(tok, make_hasher(algo, block_size, "0"))
    scratch_ms = []
    for body, hashes in zip(bodies, incremental, strict=True):
        t0 = time.perf_counter()
        fresh = await scratch.blocks_for_chat(None, body)
        scratch_ms.append((time.perf_counter() - t0) * 1000)
        assert fresh.block_hashes == hashes, "incremental != from scratch"

    cold = IncrementalTokenizer(tok, make_hasher(algo, block_size, "0"))
    await cold.blocks_for_chat("s", first)
    cold_ms = []
    for body in bodies:
        await scratch.blocks_for_chat(None, body)
        t0 = time.perf_counter()
        await cold.blocks_for_chat("s", body)
        cold_ms.append((time.perf_counter() - t0) * 1000)

    estimate = inc.sessions.session_bytes("s") or 0
    return {
        "algo": algo,
        "block_size": block_size,
        "first_turn_tokens": first_tokens,
        "last_turn_tokens": blocks.num_tokens,
        "first_turn_ms": first_ms,
        "appended_tokens_median": statistics.median(appended_tokens),
        "appended_ms_median": statistics.median(appended_ms),
        "appended_ms_max": max(appended_ms),
        "appended_after_other_work_ms_median": statistics.median(cold_ms),
        "scratch_ms_median": statistics.median(scratch_ms),
        "ratio_scratch_over_appended": statistics.median(scratch_ms) / statistics.median(appended_ms),
        "session_bytes_estimate": estimate,
        "session_bytes_measured": await measured_session_bytes(algo, first, turns, block_size),
    }


async def measured_session_bytes(
    algo: str, first: dict[str, Any], turns: list[list[dict[str, Any]]], block_size: int
) -> int:
    """Bytes the cache holds for one session after all turns (tracemalloc, request bodies excluded)."""
    bodies = []
    messages = list(first["messages"])
    for added in turns:
        messages += added
        bodies.append({**first, "messages": list(messages)})
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher(algo, block_size, "0"))
    await inc.blocks_for_chat("warm", {"messages": [{"role": "user", "content": "x"}]})
    inc.sessions.discard("warm")
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    await inc.blocks_for_chat("s", first)
    for body in bodies:
        await inc.blocks_for_chat("s", body)
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return held


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20)
    parser.add_argument(
        "--algos", default="xxh3,sha256", help="xxh3: the proxy's default (hash_algo auto); sha256: vLLM's"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--trace", type=Path)
    parser.add_argument(
        "--turn-tokens", type=int, help="append this many tokens per turn instead of the trace's"
    )
    args = parser.parse_args()
    shape = trace_shape(args.turns, args.trace)
    if args.turn_tokens:
        shape.appended = [args.turn_tokens] * args.turns
        shape.source += f" (turns forced to {args.turn_tokens} tokens)"
    first, turns = build_conversation(shape, TextMaker())
    rows = [asyncio.run(measure(algo, first, turns, args.block_size)) for algo in args.algos.split(",")]
    header = (
        f"{'algo':8} {'tokens':>15} {'+tok/turn':>9} {'first ms':>9} {'append ms':>9} "
        f"{'cold ms':>8} {'scratch ms':>10} {'ratio':>6} {'session MB':>10}"
    )
    print(f"shape: {shape.source}; block size {args.block_size}; {len(turns)} appended turns; tiktoken")
    print(
        "append ms: median of the session's turns back to back; cold ms: the same turns, each right "
        "after a from-scratch pass; medians"
    )
    print(header)
    for r in rows:
        print(
            f"{r['algo']:8} {r['first_turn_tokens']:>7}->{r['last_turn_tokens']:<7} "
            f"{r['appended_tokens_median']:>9.0f} "
            f"{r['first_turn_ms']:>9.1f} {r['appended_ms_median']:>9.2f} "
            f"{r['appended_after_other_work_ms_median']:>8.2f} {r['scratch_ms_median']:>10.1f} "
            f"{r['ratio_scratch_over_appended']:>6.0f} {r['session_bytes_measured'] / 2**20:>10.2f}"
        )
    out = OUT_DIR / (
        "tokenize_speed.json" if not args.turn_tokens else f"tokenize_speed_{args.turn_tokens}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "shape": shape.__dict__,
                "machine": {"python": sys.version.split()[0], "cpus": os.cpu_count()},
                "target_appended_ms": 2.0,
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
