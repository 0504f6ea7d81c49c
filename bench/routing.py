"""Routing benchmark: prefix index lookup cost, and fleet hit rate per policy on replayed traces.

Part 1, lookup cost: median time of one ``lookup`` for a 100k-token prompt (6,250 blocks of 16) that
4 ranks hold fully, in memory and in Redis on loopback (a redis-server is started on a free port).

Part 2, replay: 4 simulated ranks (``bench.sim``, pools of 181,777 tokens, model time off) and
``../shared/traces/claude-code`` conversations replayed concurrently, one task per session. Each
hash id becomes a fixed chunk of text (ids of the shared tool + system head are shared across
sessions); a request re-sends the longest run of the previous request's messages its ids still
start with and appends the rest as one new message. The router is driven directly (pick, forward
to the rank, observe), as the proxy pipeline does. Reported per policy: fleet hit rate (cached /
prompt tokens from the ranks' usage), prefill tokens, next to the infinite-cache bound of the
replayed prompts.

    python bench/routing.py [--sessions 16] [--turns 12] [--policies prefix_affinity,round_robin,...]
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import random
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import write_json  # noqa: E402
from routing.index.memory import MemoryPrefixIndex  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces" / "claude-code"
WORDS = [f"w{i:03d}" for i in range(900)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _hashes(n: int, tag: str) -> list[bytes]:
    import hashlib

    out, prev = [], tag.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).digest()
        out.append(prev)
    return out


def lookup_cost(repeats: int = 200) -> dict[str, Any]:
    """Median lookup time for 6,250 blocks held by 4 ranks, memory and Redis."""
    from routing.index.redis_store import RedisPrefixIndex

    blocks = _hashes(100_000 // 16, "lookup")
    results: dict[str, Any] = {}
    memory = MemoryPrefixIndex()
    for r in range(4):
        memory.set_capacity(f"r{r}", None)
        memory.record(f"r{r}", blocks)
    results["memory"] = _time(lambda: memory.lookup(blocks, "s"), repeats)
    binary = shutil.which("redis-server")
    if binary is None:
        results["redis"] = None
        return results
    port = _free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        store = RedisPrefixIndex(f"redis://127.0.0.1:{port}/0", model="bench", block_size=16)
        deadline = time.monotonic() + 10
        while True:
            try:
                store._client.ping()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
        for r in range(4):
            store.set_capacity(f"r{r}", None)
            store.record(f"r{r}", blocks)
        assert store.match(blocks) == {f"r{r}": len(blocks) for r in range(4)}
        results["redis"] = _time(lambda: store.lookup(blocks, "s"), repeats)
        results["redis_record"] = _time(lambda: store.record("r0", blocks), max(repeats // 4, 10))
        assert store.up
        store.close()
    finally:
        proc.kill()
        proc.wait(5)
    return results


def _time(fn: Any, repeats: int) -> dict[str, float]:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    samples.sort()
    return {"median_ms": statistics.median(samples), "p90_ms": samples[int(0.9 * (len(samples) - 1))]}


# -- replay -----------------------------------------------------------------------------------------


def _chunk(trace: str, block_id: int, shared: bool) -> str:
    rnd = random.Random(f"shared:{block_id}" if shared else f"{trace}:{block_id}")
    return " ".join(rnd.choice(WORDS) for _ in range(40)) + "\n"


def load_sessions(n: int, turns: int) -> list[tuple[str, int, list[list[int]]]]:
    files = sorted(TRACES.glob("*.json.gz"))[:n]
    sessions = []
    for f in files:
        with gzip.open(f) as fh:
            data = json.load(fh)
        head = (data.get("tool_tokens", 0) + data.get("system_tokens", 0)) // data["block_size"]
        requests = [r["hash_ids"] for r in data["requests"] if r.get("hash_ids")][:turns]
        sessions.append((f.name.split(".")[0], head, requests))
    return sessions


def build_messages(
    trace: str, head: int, ids: list[int], previous: list[tuple[tuple[int, ...], dict[str, str]]]
) -> list[tuple[tuple[int, ...], dict[str, str]]]:
    """Reuse the previous request's leading messages its ids still match; append the rest."""
    out: list[tuple[tuple[int, ...], dict[str, str]]] = []
    pos = 0
    for group, message in previous:
        if tuple(ids[pos : pos + len(group)]) != group:
            break
        out.append((group, message))
        pos += len(group)
    if not out:
        system = tuple(ids[:head])
        text = "".join(_chunk(trace, i, shared=k < head) for k, i in enumerate(system))
        out.append((system, {"role": "system", "content": text}))
        pos = len(system)
    rest = tuple(ids[pos:])
    if rest:
        role = "user" if out[-1][1]["role"] != "user" else "assistant"
        out.append((rest, {"role": role, "content": "".join(_chunk(trace, i, False) for i in rest)}))
    return out


async def replay(policy: str, sessions: list[Any], kv_tokens: int) -> dict[str, Any]:
    from bench.sim import SimConfig, start_fleet, stop_fleet
    from bench.sim.prompts import PromptProcessor
    from proxy.route import Router
    from routing.backends import Backend, BackendPool
    from routing.policy import make_policy
    from tests.routing.conftest import make_ctx
    from tokenization.block_hash import BlockHasher

    fleet = start_fleet(4, SimConfig(kv_tokens=kv_tokens, time_scale=0, hash_seed="0"))
    try:
        pool = BackendPool(Backend(r.name, r.url, pool_tokens=kv_tokens, block_size=16) for r in fleet)
        router = Router(pool, make_policy(policy), MemoryPrefixIndex())
        hasher = BlockHasher(16, "sha256", seed="0")
        prompts = PromptProcessor(hasher)
        seen: set[bytes] = set()
        totals = {"prompt": 0, "cached": 0, "bound": 0, "requests": 0}
        async with httpx.AsyncClient(timeout=120) as client:

            async def run(trace: str, head: int, requests: list[list[int]]) -> None:
                previous: list[Any] = []
                for ids in requests:
                    previous = build_messages(trace, head, ids, previous)
                    messages = [m for _, m in previous]
                    prompt = prompts.chat(messages)
                    n = len(prompt.token_ids)
                    limit = (n - 1) // 16
                    held = 0
                    for h in prompt.block_hashes[:limit]:
                        if h not in seen:
                            break
                        held += 1
                    seen.update(prompt.block_hashes)
                    ctx = make_ctx(trace, list(prompt.block_hashes), n)
                    backend = router.pick(ctx)
                    backend.in_flight += 1
                    try:
                        body = {"model": "prefixgate-sim", "messages": messages, "max_tokens": 8}
                        answer = (await client.post(backend.url + "/v1/chat/completions", json=body)).json()
                    finally:
                        backend.in_flight -= 1
                    usage = answer["usage"]
                    cached = usage["prompt_tokens_details"]["cached_tokens"]
                    router.observe(ctx, backend, cached)
                    totals["prompt"] += usage["prompt_tokens"]
                    totals["cached"] += cached
                    totals["bound"] += held * 16
                    totals["requests"] += 1

            await asyncio.gather(*(run(*s) for s in sessions))
    finally:
        stop_fleet(fleet)
    prompt = totals["prompt"]
    return {
        "policy": policy,
        "requests": totals["requests"],
        "prompt_tokens": prompt,
        "hit_rate": totals["cached"] / prompt if prompt else 0.0,
        "bound_hit_rate": totals["bound"] / prompt if prompt else 0.0,
        "prefill_tokens": prompt - totals["cached"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=12, help="requests replayed per trace")
    parser.add_argument("--kv-tokens", type=int, default=181_777)
    parser.add_argument("--policies", default="prefix_affinity,session_hash,least_loaded,round_robin")
    parser.add_argument("--skip-replay", action="store_true")
    args = parser.parse_args(argv)

    out: dict[str, Any] = {"lookup": lookup_cost()}
    print("index lookup, 100k-token prompt (6,250 blocks), 4 ranks holding it:")
    for store, r in out["lookup"].items():
        if r:
            print(f"  {store:13s} median {r['median_ms']:.3f} ms   p90 {r['p90_ms']:.3f} ms")
    if not args.skip_replay:
        if not TRACES.is_dir():
            print(f"replay skipped: {TRACES} not found")
        else:
            sessions = load_sessions(args.sessions, args.turns)
            out["replay"] = {
                "sessions": len(sessions),
                "turns": args.turns,
                "kv_tokens": args.kv_tokens,
                "runs": [],
            }
            print(
                f"\nreplay: {len(sessions)} sessions x {args.turns} requests, "
                f"4 ranks of {args.kv_tokens:,} tokens"
            )
            print(f"{'policy':16s} {'hit rate':>9s} {'bound':>7s} {'of bound':>9s} {'prefill tokens':>15s}")
            for policy in args.policies.split(","):
                t0 = time.perf_counter()
                r = asyncio.run(replay(policy, sessions, args.kv_tokens))
                r["seconds"] = time.perf_counter() - t0
                out["replay"]["runs"].append(r)
                ratio = r["hit_rate"] / r["bound_hit_rate"] if r["bound_hit_rate"] else 0.0
                print(
                    f"{policy:16s} {r['hit_rate']:9.3f} {r['bound_hit_rate']:7.3f} {ratio:9.3f} "
                    f"{r['prefill_tokens']:15,d}"
                )
    path = write_json("routing", out)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
