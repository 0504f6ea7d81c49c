"""What the Redis prefix index costs Redis per request, on the shape agents send.

``--sessions`` conversations of ``--tokens`` tokens each (``--block-size`` tokens per block) grow by
``--growth`` tokens a turn for ``--turns`` turns, dealt round robin over ``--ranks`` ranks; every
request does what routing does: one lookup (match + session rank), one record of the whole chain
on its rank, one session binding. Redis is a throw-away ``redis-server`` on a loopback port; its
own counters (``INFO commandstats``, ``INFO cpu``) give per request: commands Redis ran (those of
the scripts included), script calls (round trips), the microseconds Redis spent in them, and
Redis's CPU time. ``--root DIR`` imports the index from another checkout, so that two trees are
measured side by side on the same machine (run it twice, alternating)::

    python -m bench.redis_index [--root ../base] [--sessions 16] [--turns 12] [--tokens 100000]

Writes ``bench/out/redis_index[-LABEL].json``.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Any


def _chain(tag: str, n: int, parent: bytes) -> list[bytes]:
    out, prev = [], parent
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev)
    return out


def _counters(client: Any) -> dict[str, float]:
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    return {
        "calls": float(sum(v["calls"] for v in stats.values())),
        "usec": float(sum(v["usec"] for v in stats.values())),
        "scripts": float(sum(v["calls"] for k, v in stats.items() if k.startswith("cmdstat_evalsha"))),
        "cpu_s": float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.root:
        sys.path.insert(0, str(Path(args.root).resolve()))
    import redis

    from bench.common import redis_server
    from routing.index.redis_store import RedisPrefixIndex

    with redis_server() as url:
        if url is None:
            raise SystemExit("bench.redis_index needs redis-server (apt-get install redis-server)")
        index = RedisPrefixIndex(url, model="m", block_size=args.block_size)
        return _measure(args, redis.Redis.from_url(url), index)


def _measure(args: argparse.Namespace, client: Any, index: Any) -> dict[str, Any]:
    """Replays the conversations through ``index`` and reads what Redis (``client``) counted."""
    ranks = [f"rank-{i}" for i in range(args.ranks)]
    for rank in ranks:
        index.set_capacity(rank, args.capacity_blocks or None)
    shared = _chain("system", args.tokens // 5 // args.block_size, b"")
    chains = {
        s: shared + _chain(f"s{s}", args.tokens // args.block_size - len(shared), shared[-1])
        for s in range(args.sessions)
    }
    growth = max(1, args.growth // args.block_size)
    requests = 0
    index.flush()
    before = _counters(client)
    started = time.perf_counter()
    for turn in range(args.turns):
        for s, blocks in chains.items():
            if turn:
                blocks += _chain(f"s{s}t{turn}", growth, blocks[-1])
            key = f"session-{s}"
            index.lookup(blocks, key)
            rank = ranks[s % len(ranks)]
            index.record(rank, blocks)
            index.set_session_rank(key, rank)
            requests += 1
    index.flush(timeout=120)
    wall = time.perf_counter() - started
    after = _counters(client)
    index.close()
    client.close()
    per = {k: (after[k] - before[k]) / requests for k in after}
    return {
        "root": args.root or str(Path(__file__).resolve().parents[1]),
        "requests": requests,
        "blocks_per_request": round(sum(len(c) for c in chains.values()) / len(chains)),
        "redis_commands_per_request": round(per["calls"], 1),
        "round_trips_per_request": round(per["scripts"] + 1, 2),  # the scripts, plus the session SET
        "redis_usec_per_request": round(per["usec"], 1),
        "redis_cpu_ms_per_request": round(per["cpu_s"] * 1000, 3),
        "requests_per_s_one_client": round(requests / wall, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="import the index from this checkout")
    parser.add_argument("--label", default="", help="suffix of the JSON file's name")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=100_000, help="a conversation's first turn")
    parser.add_argument("--growth", type=int, default=1_000, help="tokens added per turn")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--capacity-blocks", type=int, default=0, help="per rank (0: unbounded)")
    args = parser.parse_args(argv)
    figures = run(args)
    for key, value in figures.items():
        print(f"{key:>30}: {value}")
    from bench.common import write_json

    write_json("redis_index" + (f"-{args.label}" if args.label else "") + ".json", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
