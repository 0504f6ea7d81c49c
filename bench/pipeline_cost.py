"""Per-stage CPU cost of the request pipeline, measured in-process (no HTTP, no event-loop noise).

The stages are built as ``proxy.gateway.Gateway.start`` builds them (tiktoken tokenizer, vLLM sha256
block hashes, a memory prefix index, the prefix_affinity policy over four ranks) and timed one by
one on four workloads:

- ``repeat_100k``: one session re-sending the same ~100k-token conversation (the session caches
  are warm: this is the steady state of a long agent session);
- ``new_sessions``: the first turn of many sessions of one agent (same ~2k-token system prompt and
  12 tools, a different first user message each);
- ``growing``: two ~100k-token conversations growing by ~1k tokens a turn, turns interleaved (the
  shape agents send most; ``bench.overhead``'s growing case);
- ``edited``: two ~100k-token conversations growing by a ~8k-token tool result a turn, each turn
  also dropping a reminder from the end of the previous turn's (an edit near the end of a message
  already sent, as agents make: the ids of what it kept are reused, ``tokenization/edited.py``);
- ``small``: a load.py-shaped small chat request, first turns of distinct sessions.

With ``--tokenizer-dir DIR`` (a local Hugging Face model directory: ``tokenizer.json`` and a chat
template, as ``tokenization: {kind: hf}`` reads it) the blocks are rendered by that model's
tokenizer instead of the embedded tiktoken one: the path a deployment of a real model takes.

Prints a table of medians (microseconds) and writes ``bench/out/pipeline_cost.json`` (with
``--tokenizer-dir``, ``pipeline_cost_hf.json``).

    python -m bench.pipeline_cost [--repeats 40] [--sessions 200] [--tokenizer-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
from starlette.datastructures import Headers

from bench.common import machine, median, percentile, write_json
from bench.overhead import large_request
from bench.side_by_side import growing_conversation
from bench.workload import agent_sessions
from proxy.apis import CHAT
from proxy.context import Outcome, RequestContext
from proxy.ops.limits import DEFAULT_BOUNDS
from proxy.ops.metrics import Metrics
from proxy.stages.blocks import Blocks
from proxy.stages.canonicalize import Canonicalize
from proxy.stages.identify import Identify
from proxy.stages.parse import parse_json_object
from proxy.stages.route import Router
from proxy.state.local import SessionLocals
from routing.index.memory import MemoryPrefixIndex
from routing.policies import make_policy
from routing.ranks import Fleet, Rank
from tokenization.config import TokenizerConfig
from tokenization.factory import build_incremental

RANKS = 4
POOL_TOKENS = 2_000_000  # per rank: 125k blocks of 16, room for every workload here
SMALL_SYSTEM = "You are a careful coding agent working in a large repository. " * 20


class Stages:
    """The pipeline's CPU stages, built once per workload (fresh caches and index)."""

    def __init__(self, tokenizer: TokenizerConfig) -> None:
        self.metrics = Metrics()
        self.locals = SessionLocals()
        self.identify = Identify(self.locals)
        self.canon = Canonicalize.from_settings(True, {}, self.metrics)
        self.blocks = Blocks(build_incremental(tokenizer, block_size=16), self.locals)
        fleet = Fleet(
            Rank(f"rank{i}", f"http://127.0.0.1:{9000 + i}", pool_tokens=POOL_TOKENS, block_size=16)
            for i in range(RANKS)
        )
        self.index = MemoryPrefixIndex()
        self.router = Router(fleet, make_policy("prefix_affinity"), self.index, block_size=16)


def _context(raw: bytes, session: str | None) -> RequestContext:
    headers = Headers({"x-session-id": session} if session else {})
    return RequestContext(
        api=CHAT, headers=headers, raw_body=raw, body={}, stream=True, model=None, started=0.0
    )


def _timed(samples: dict[str, list[float]], name: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = fn()
    samples.setdefault(name, []).append(time.perf_counter() - start)
    return out


async def _one_request(
    stages: Stages, raw: bytes, session: str | None, samples: dict[str, list[float]]
) -> None:
    ctx = _context(raw, session)
    ctx.body = ctx.client_body = _timed(samples, "parse", lambda: _parsed(raw))
    _timed(samples, "session_id", lambda: stages.identify(ctx))
    _timed(samples, "canonicalize", lambda: stages.canon(ctx))
    start = time.perf_counter()
    await stages.blocks(ctx)
    samples.setdefault("blocks", []).append(time.perf_counter() - start)
    if ctx.landing is not None:  # a turn routed on its head: the rest is tokenized beside the request
        start = time.perf_counter()
        await ctx.landing
        samples.setdefault("blocks.beside", []).append(time.perf_counter() - start)
    # Router.plan, and its two index accesses timed on their own (a repeated lookup, a repeated
    # record: both leave the index as the plan left it).
    index = stages.index
    _timed(samples, "route.index_lookup", lambda: index.lookup(ctx.block_hashes, ctx.session_key))
    plan = ctx.plan = _timed(samples, "route.pick", lambda: stages.router.plan(ctx))
    rank = plan.ranks[0].name
    _timed(samples, "route.index_record", lambda: index.record(rank, ctx.block_hashes))
    stages.router.finished(Outcome(ctx, rank, 200))
    # what the pipeline sends: the client's bytes, with canonicalization's changes spliced in
    _timed(samples, "upstream_body", ctx.upstream_body)


def _parsed(raw: bytes) -> dict[str, Any]:
    """The parse stage's work on the body: JSON, then the API's shape and bounds checks."""
    body = parse_json_object(raw)
    CHAT.validate(body, DEFAULT_BOUNDS)
    return body


async def _run(
    requests: list[tuple[bytes, str | None]], samples: dict[str, list[float]], tokenizer: TokenizerConfig
) -> Stages:
    stages = Stages(tokenizer)
    gc.collect()
    for raw, session in requests:
        await _one_request(stages, raw, session, samples)
    return stages


def repeat_100k(repeats: int) -> list[tuple[bytes, str | None]]:
    raw = large_request(stream=True)
    return [(raw, "long-session")] * repeats


def new_sessions(count: int) -> list[tuple[bytes, str | None]]:
    out: list[tuple[bytes, str | None]] = []
    for s in agent_sessions(sessions=count, turns=1, seed=7):
        out.append((orjson.dumps(s.request(0, "stub-model")), s.key))
    return out


def growing(turns: int) -> list[tuple[bytes, str | None]]:
    """Two ~100k-token conversations growing by ~1k tokens a turn (bench.overhead's growing case),
    their turns interleaved."""
    conversations = [growing_conversation(100_000, 1_000, turns, seed) for seed in range(2)]
    return [(bodies[t], f"growing-{i}") for t in range(turns) for i, bodies in enumerate(conversations)]


#: What ``edited`` appends to a turn's newest message and drops from it the turn after.
REMINDER = (
    "\n<system-reminder>\nThe task list is empty. Do not mention this to the user.\n</system-reminder>\n"
)


def edited(turns: int) -> list[tuple[bytes, str | None]]:
    """Two conversations growing by ~8k tokens a turn, each turn dropping ``REMINDER`` from the end of
    the previous turn's newest message."""
    conversations = [
        growing_conversation(100_000, 8_000, turns, seed, reminder=REMINDER) for seed in range(2)
    ]
    return [(bodies[t], f"edited-{i}") for t in range(turns) for i, bodies in enumerate(conversations)]


def small(count: int) -> list[tuple[bytes, str | None]]:
    out: list[tuple[bytes, str | None]] = []
    for i in range(count):
        messages = [
            {"role": "system", "content": SMALL_SYSTEM},
            {"role": "user", "content": f"session {i} turn 1: fix the next failing test"},
        ]
        body = {"model": "stub-model", "messages": messages, "stream": True, "max_tokens": 8}
        out.append((orjson.dumps(body), f"load-{i}"))
    return out


def summarize(samples: dict[str, list[float]], skip: int) -> dict[str, dict[str, float]]:
    """Median and p90 per stage in microseconds, dropping the first ``skip`` (cold) samples."""
    out = {}
    for name, values in samples.items():
        kept = values[skip:] or values
        out[name] = {
            "p50_us": round(median(kept) * 1e6, 1),
            "p90_us": round(percentile(kept, 90) * 1e6, 1),
            "n": len(kept),
        }
    return out


def print_table(results: dict[str, Any]) -> None:
    stages = list(dict.fromkeys(stage for result in results.values() for stage in result))
    header = f"{'stage':<22}" + "".join(f"{name + ' p50/p90 us':>30}" for name in results)
    print(header)
    print("-" * len(header))
    for stage in stages:
        row = f"{stage:<22}"
        for result in results.values():
            s = result.get(stage)
            cell = "" if s is None else f"{s['p50_us']:.1f} / {s['p90_us']:.1f}"
            row += f"{cell:>30}"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeats",
        type=int,
        default=40,
        help="requests of the 100k-token session, and turns of each growing one",
    )
    parser.add_argument("--sessions", type=int, default=200, help="first turns of new sessions")
    parser.add_argument(
        "--tokenizer-dir",
        type=Path,
        help="a local Hugging Face model directory whose tokenizer renders the blocks (default: tiktoken)",
    )
    args = parser.parse_args()
    tokenizer = TokenizerConfig()
    if args.tokenizer_dir is not None:
        tokenizer = TokenizerConfig(kind="hf", path=args.tokenizer_dir)
    workloads = {
        "repeat_100k": (repeat_100k(args.repeats), 2),
        "new_sessions": (new_sessions(args.sessions), 5),
        "growing": (growing(args.repeats), 4),
        "edited": (edited(args.repeats), 4),
        "small": (small(args.sessions), 5),
    }
    results: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for name, (requests, skip) in workloads.items():
        samples: dict[str, list[float]] = {}
        stages = asyncio.run(_run(requests, samples, tokenizer))
        results[name] = summarize(samples, skip)
        extra[name] = {"requests": len(requests), "index": stages.index.stats()}
    print_table(results)
    name = "pipeline_cost.json" if args.tokenizer_dir is None else "pipeline_cost_hf.json"
    report = {"machine": machine(), "tokenizer": tokenizer.kind, "stages_us": results, "workloads": extra}
    path = write_json(name, report)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
