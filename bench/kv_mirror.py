"""What following one rank's KV events costs the proxy: a simulated rank's feed, replayed into the mirror.

Behind ranks with 16-token blocks and a CPU tier, applying the ranks' KV events is a large share of
the proxy's CPU (a GIL-sampled py-spy profile of the issue-47 cell put it at about 40 %). This times
it alone, without the noise of a fleet sharing the machine:

1. *Record.* ``bench.sim``'s engine is stepped here without a clock or HTTP, serving agent-like
   sessions (each turn re-sends its whole conversation, the answer included, plus new tokens), with
   a pool smaller than their contexts and a CPU tier behind it. Every batch of events it emits is
   encoded as vLLM 0.33 sends it. ``--payloads FILE`` keeps the feed (and reads it back if it exists).
2. *Replay.* The feed is applied to a fresh ``RankMirror`` over the in-memory index, ``--rounds``
   times; the median seconds, events and microseconds per event are printed and written as JSON.

``--tree PATH`` replays with another checkout's ``routing`` and ``tokenization`` (a feed recorded
before), so two commits can be timed on the same feed, side by side::

    python -m bench.kv_mirror --payloads /tmp/feed.bin            # records, then replays
    farm-bench --vs 'python -m bench.kv_mirror --payloads /tmp/feed.bin --tree /old/checkout' \\
        -- python -m bench.kv_mirror --payloads /tmp/feed.bin
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import struct
import sys
import time
from pathlib import Path
from typing import Any

#: Length prefix of each batch in a ``--payloads`` file.
_FRAME = struct.Struct(">Q")


def record(args: argparse.Namespace) -> list[bytes]:
    """The feed of one simulated rank serving ``args.sessions`` sessions of ``args.turns`` turns."""
    from bench.sim.config import SimConfig
    from bench.sim.kv_events import encode_batch
    from bench.sim.prompts import Prompt
    from bench.sim.scheduler import Engine
    from bench.sim.sequences import SimRequest

    config = SimConfig(
        block_size=args.block_size,
        kv_tokens=args.kv_tokens,
        cpu_tier_tokens=args.cpu_tier * args.kv_tokens,
        max_model_len=1 << 30,
    )
    feed: list[bytes] = []
    engine = Engine(config, on_events=lambda ts, events: None)  # records events; taken below
    rng = random.Random(args.seed)
    conversations = [
        [rng.randrange(100, 50_000) for _ in range(args.head_tokens)] for _ in range(args.sessions)
    ]
    turns_left = [args.turns] * args.sessions
    in_flight: dict[int, SimRequest] = {}

    def send(session: int) -> None:
        conversation = conversations[session]
        conversation.extend(rng.randrange(100, 50_000) for _ in range(rng.randint(*args.turn_tokens)))
        tokens = list(conversation)
        prompt = Prompt(tokens, engine.hasher.hash_blocks(tokens))
        (req,), _ = engine.submit(prompt, args.answer_tokens)
        in_flight[session] = req
        turns_left[session] -= 1

    for session in range(args.sessions):
        send(session)
    while in_flight:
        plan = engine.schedule()
        engine.update(plan)
        events = engine.pool.take_events()
        if events:
            feed.append(encode_batch(time.time(), events))
        for session, req in list(in_flight.items()):
            if req.finish_reason is not None:
                conversations[session].extend(req.output_token_ids)  # the agent re-sends the answer
                del in_flight[session]
                if turns_left[session]:
                    send(session)
    return feed


def replay(feed: list[bytes], block_size: int, rounds: int) -> dict[str, Any]:
    """Median seconds to decode and apply ``feed`` to a fresh mirror, over ``rounds`` rounds."""
    from routing import kv_events
    from routing.index.inflight import InFlightBlocks
    from routing.index.memory import MemoryPrefixIndex
    from routing.kv_events import KVEventSubscriber, RankMirror
    from tokenization.block_hash import Xxh3ChainHasher

    seconds = []
    events = 0
    for _ in range(rounds):
        index, in_flight = MemoryPrefixIndex(), InFlightBlocks()
        in_flight.add("r0", [bytes(16)])  # something in flight: each store confirms, as in a proxy
        mirror = RankMirror("r0", index, Xxh3ChainHasher(block_size), on_stored=in_flight.confirm)
        # A subscriber never started: its batch handling, not its socket (payloads fed in order). Its
        # private _handle is the one seam the trees before the typed decoder share (--tree).
        subscriber = KVEventSubscriber(mirror, "tcp://127.0.0.1:1")
        started = time.perf_counter()
        for seq, payload in enumerate(feed):
            subscriber._handle(seq, payload)
        seconds.append(time.perf_counter() - started)
        events = mirror.applied
    median = statistics.median(seconds)
    return {
        "mirror": kv_events.__file__,  # which checkout's code was timed
        "batches": len(feed),
        "events": events,
        "rounds": rounds,
        "seconds_median": round(median, 4),
        "seconds": [round(s, 4) for s in seconds],
        "us_per_event": round(median / max(events, 1) * 1e6, 3),
    }


def _read(path: Path) -> list[bytes]:
    data, feed, at = path.read_bytes(), [], 0
    while at < len(data):
        (size,) = _FRAME.unpack_from(data, at)
        feed.append(data[at + _FRAME.size : at + _FRAME.size + size])
        at += _FRAME.size + size
    return feed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_mirror", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=8, help="sessions served at once (default 8)")
    parser.add_argument("--turns", type=int, default=12, help="turns per session (default 12)")
    parser.add_argument("--head-tokens", type=int, default=6_000, help="first prompt (default 6,000)")
    parser.add_argument(
        "--turn-tokens", type=int, nargs=2, default=(200, 3_000), help="new tokens a turn adds, min max"
    )
    parser.add_argument("--answer-tokens", type=int, default=256, help="tokens a turn answers (default 256)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (default 16, vLLM's)")
    parser.add_argument("--kv-tokens", type=int, default=85_280, help="GPU pool (default: the cell's)")
    parser.add_argument("--cpu-tier", type=int, default=4, help="CPU tier, in pools (default 4; 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=5, help="replays timed (default 5; the median)")
    parser.add_argument("--payloads", type=Path, help="the feed: read if it exists, else recorded there")
    parser.add_argument("--tree", type=Path, help="replay with this checkout's routing and tokenization")
    parser.add_argument("--out", type=Path, default=Path("kv_mirror.json"), help="JSON written here")
    args = parser.parse_args(argv)
    if args.payloads is not None and args.payloads.exists():
        feed = _read(args.payloads)
    else:
        if args.tree is not None:
            parser.error("--tree replays a recorded feed: give --payloads FILE recorded before")
        feed = record(args)
        if args.payloads is not None:
            args.payloads.write_bytes(b"".join(_FRAME.pack(len(p)) + p for p in feed))
    if args.tree is not None:
        sys.path.insert(0, str(args.tree.resolve()))
    result = {"tree": str(args.tree or "."), **replay(feed, args.block_size, args.rounds)}
    print(
        f"{result['batches']:,} batches, {result['events']:,} events: {result['seconds_median']} s "
        f"(median of {args.rounds}), {result['us_per_event']} us an event"
    )
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
