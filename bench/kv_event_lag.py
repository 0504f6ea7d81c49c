"""KV events with many replicas: how late each replica's index view shows a rank's event, whether
two replicas' views agree, and how much work each replica does for the same events.

In this process: ``--ranks`` simulated ranks publishing KV events (pools small enough to evict),
two replicas ``A`` and ``B`` with ``--kv-events auto`` on one embedded redis-server, and
``--sessions`` conversations whose turns are dealt to ``A`` and ``B`` in turn. Beside them, on a
second Redis, the alternative: ONE subscriber writes each rank's mirror into Redis and a reader
subscribed to nothing sees it through Redis only (``shared``).

A sequence clock times when each subscription (a probe's, ``A``'s, ``B``'s, the shared writer's)
applied each batch, behind the first of them (0.2 ms resolution). Pollers, one per view (``A``,
``B``, ``shared``: the index's own ``lookup``), time when the last block of each ``BlockStored``
and the first of each ``BlockRemoved`` shows there, behind the probe (their lookups bound their
resolution; all share this process's GIL, which inflates every view alike). A sampler compares the
views on stored blocks at one instant: ``A~B`` is the share on which they agree, ``~probe`` each
against the probe's mirror. Events applied and chains written to Redis come from the replicas'
subscriptions and indexes. Only the lags involve a clock, measured, never scaled (no think time).

Decision (README, "Replicas and workers"): every replica subscribes to every rank's events and
keeps its own exact mirror, and ONE replica per rank (the holder of a lease in Redis) also writes
the rank's mirror to the shared index (``routing/index/redis_store.py``), for replicas that started
after the rank or whose subscription failed. Measured (defaults; three runs beside three of the
code before the lease): each replica applied every batch within 0.6 ms p50 (8 ms p99) of the first
subscriber; a stored block showed in a replica's own view at 0.73-0.8x the p50 lag of the shared
mirror read through Redis; the views agreed on 100% of about 3,000 sampled blocks a run; chains
written to Redis 288 + 288 before (every replica wrote every event), 288 in all with the lease.
Sharing one mirror instead adds the writer's and the reader's Redis round trips to every event,
still needs a writer elected, and leaves no exact view while Redis is down.

    python -m bench.kv_event_lag [--sessions 16] [--turns 6] [--concurrency 4] [--ranks 2]

Writes ``bench/out/kv_event_lag[-LABEL].json``.
"""

from __future__ import annotations

import argparse
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from bench.common import median, percentile, write_json
from bench.sim import SimConfig, SimRankServer, start_fleet, stop_fleet
from proxy.app import create_app
from proxy.config import load_settings
from proxy.gateway import Gateway
from proxy.server import ServerThread
from proxy.state.embedded_redis import EmbeddedRedis
from routing.index import GPU, PrefixIndex
from routing.index.memory import MemoryPrefixIndex
from routing.index.redis_store import RedisPrefixIndex
from routing.kv_events import KVEventSubscriber, RankMirror
from tokenization.config import TokenizerConfig, resolve_hash_algo
from tokenization.hashers import ChainHasher, make_hasher

#: A view not showing an event this long after the probe applied it counts as unseen.
GIVE_UP_S = 5.0
SAMPLE_EVERY_S = 0.1
SAMPLE_BLOCKS = 16
VIEWS = ("A", "B", "shared")


class Pending:
    """One event the poller waits for: ``block`` held (stored) or not (removed) on ``rank``."""

    __slots__ = ("at", "block", "held", "rank")

    def __init__(self, at: float, rank: str, block: bytes, held: bool) -> None:
        self.at, self.rank, self.block, self.held = at, rank, block, held


class Probe(MemoryPrefixIndex):
    """The probe's mirror: an exact ``MemoryPrefixIndex`` that also notes each event it applies."""

    def __init__(self) -> None:
        super().__init__()
        #: per view, the events its poller waits for
        self.pending: dict[str, list[Pending]] = {view: [] for view in VIEWS}
        self.stored: dict[str, list[bytes]] = {}
        self.note = threading.Lock()

    def record(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        super().record(rank, block_hashes, counted=counted, medium=medium)
        if block_hashes:
            self._wait_for(Pending(time.perf_counter(), rank, block_hashes[-1], True))
            with self.note:
                self.stored.setdefault(rank, []).extend(block_hashes)

    def remove(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        super().remove(rank, block_hashes, counted=counted, medium=medium)
        gone = self.missing(rank, block_hashes[:1])
        if gone:
            self._wait_for(Pending(time.perf_counter(), rank, gone[0], False))

    def _wait_for(self, event: Pending) -> None:
        with self.note:
            for pending in self.pending.values():
                pending.append(event)


def holds(index: PrefixIndex, rank: str, block: bytes) -> bool:
    """Whether ``index``'s view (its lookup, as routing sees it) shows ``block`` on ``rank``."""
    return index.lookup([block], None).matches.get(rank, 0) > 0


def subscribe(rank: SimRankServer, index: PrefixIndex, hasher: ChainHasher) -> KVEventSubscriber:
    assert rank.kv_events_endpoint is not None
    mirror = RankMirror(rank.name, index, hasher)
    return KVEventSubscriber(mirror, rank.kv_events_endpoint, rank.kv_replay_endpoint, "kv").start()


class SeqClock:
    """When each subscriber (by name) first applied each of its rank's batches: ``last_seq`` read in a
    tight loop, a plain int, so the clock costs the subscribers nothing."""

    def __init__(self, subscribers: dict[str, list[KVEventSubscriber]]) -> None:
        self.subscribers = subscribers
        #: name -> (rank, seq) -> when that subscriber had applied it
        self.at: dict[str, dict[tuple[str, int], float]] = {name: {} for name in subscribers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> SeqClock:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        reached = {(name, s.mirror.rank): -1 for name, subs in self.subscribers.items() for s in subs}
        while not self._stop.is_set():
            now = time.perf_counter()
            for name, subs in self.subscribers.items():
                times = self.at[name]
                for sub in subs:
                    rank, seq = sub.mirror.rank, sub.last_seq
                    for applied in range(reached[name, rank] + 1, seq + 1):
                        times[rank, applied] = now
                    reached[name, rank] = max(seq, reached[name, rank])
            time.sleep(0.0002)

    def lags(self) -> dict[str, list[float]]:
        """Per subscriber, how long after the first subscriber to apply each batch it applied it."""
        first: dict[tuple[str, int], float] = {}
        for times in self.at.values():
            for batch, at in times.items():
                first[batch] = min(at, first.get(batch, at))
        return {name: [at - first[batch] for batch, at in times.items()] for name, times in self.at.items()}


class Watch:
    """The poller and the sampler, each in its own thread, over the views of ``views``."""

    def __init__(self, probe: Probe, views: dict[str, PrefixIndex]) -> None:
        self.probe, self.views = probe, views
        self.lags: dict[str, dict[str, list[float]]] = {v: {"stored": [], "removed": []} for v in VIEWS}
        self.unseen: dict[str, int] = dict.fromkeys(VIEWS, 0)
        self.agree: dict[str, list[int]] = {"A~B": [], "A~probe": [], "B~probe": [], "shared~probe": []}
        self._stop = threading.Event()
        # one poller per view: a slow view's backlog must not delay another's checks
        self._threads = [threading.Thread(target=self._poll, args=(v,), daemon=True) for v in VIEWS]
        self._threads.append(threading.Thread(target=self._sample, daemon=True))

    def start(self) -> Watch:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        time.sleep(GIVE_UP_S)  # let the last events be seen or given up on
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def _poll(self, view: str) -> None:
        index, lags = self.views[view], self.lags[view]
        while not self._stop.is_set():
            with self.probe.note:
                pending, self.probe.pending[view] = self.probe.pending[view], []
            waiting = []
            for item in pending:
                seen = holds(index, item.rank, item.block) == item.held
                now = time.perf_counter()
                if seen:
                    lags["stored" if item.held else "removed"].append(now - item.at)
                elif now - item.at > GIVE_UP_S:
                    self.unseen[view] += 1
                else:
                    waiting.append(item)
            with self.probe.note:
                self.probe.pending[view][:0] = waiting
            time.sleep(0.0005)

    def _sample(self) -> None:
        rng = random.Random(7)
        while not self._stop.wait(SAMPLE_EVERY_S):
            with self.probe.note:
                drawn = {
                    rank: [blocks[rng.randrange(len(blocks))] for _ in range(SAMPLE_BLOCKS)]
                    for rank, blocks in self.probe.stored.items()
                    if blocks
                }
            for rank, blocks in drawn.items():
                for block in blocks:
                    seen = {name: holds(index, rank, block) for name, index in self.views.items()}
                    truth = not self.probe.missing(rank, [block])
                    self.agree["A~B"].append(seen["A"] == seen["B"])
                    for view in VIEWS:
                        self.agree[f"{view}~probe"].append(seen[view] == truth)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"lag_ms": {}, "unseen": self.unseen}
        for view, kinds in self.lags.items():
            out["lag_ms"][view] = {
                kind: {
                    "n": len(lags),
                    "p50": median(lags) * 1e3,
                    "p99": percentile(lags, 99) * 1e3,
                }
                for kind, lags in kinds.items()
            }
        out["agreement"] = {pair: (sum(v) / len(v) if v else None) for pair, v in self.agree.items()}
        out["samples"] = len(self.agree["A~B"])
        return out


def converse(urls: list[str], session: int, turns: int, tokens: int) -> int:
    """One agent session, its turns dealt to ``urls`` in turn; the requests that failed."""
    agent = session % 2  # two agents: a shared system prompt each
    history: list[dict[str, str]] = [
        {"role": "system", "content": f"You are coding agent {agent}. Follow the rules. " * (tokens // 10)}
    ]
    failed = 0
    with httpx.Client(timeout=60) as client:
        for turn in range(turns):
            history.append({"role": "user", "content": f"s{session} t{turn}: " + "fix the tests. " * 60})
            url = urls[(session + turn) % len(urls)]
            body = {"model": "sim", "messages": history, "max_tokens": 32}
            answer = client.post(
                url + "/v1/chat/completions", json=body, headers={"x-session-id": f"s{session}"}
            )
            if answer.status_code != 200:
                failed += 1
                history.pop()
                continue
            history.append(answer.json()["choices"][0]["message"])
    return failed


def redis_commands(server: EmbeddedRedis) -> int:
    import redis

    client = redis.Redis.from_url(server.url)
    try:
        return int(sum(v["calls"] for v in client.info("commandstats").values()))
    finally:
        client.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    fleet = start_fleet(
        args.ranks, SimConfig(time_scale=args.time_scale, kv_tokens=args.pool_tokens, kv_events=True)
    )
    shared_redis, alternative_redis = EmbeddedRedis().start(), EmbeddedRedis().start()
    stops: list[Callable[[], None]] = []
    try:
        specs = [f"{s.config.name}={s.url}" for s in fleet]
        flags = {"redis_url": shared_redis.url, "log_level": "error", "kv_events": "auto"}
        flags["session_idle_ttl"] = args.idle_ttl  # turns come back to back: a session quiet this long ended
        apps = [create_app(load_settings(flags=flags, backend_specs=specs, environ={})) for _ in range(2)]
        replicas = []
        for app in apps:
            replicas.append(ServerThread(app).start())
            stops.append(replicas[-1].stop)
        gateways: list[Gateway] = [app.state.gateway for app in apps]
        routers = [g.router for g in gateways if g.router is not None]
        assert len(routers) == 2
        settings = gateways[0].settings
        config = TokenizerConfig.model_validate(settings.tokenization)
        algo = resolve_hash_algo(config.hash_algo, compare_with_rank=False)
        hasher = make_hasher(algo, routers[0].block_size, config.hash_seed, config.cache_salt_style)
        # the alternative: one mirror written to Redis by one subscriber, read through Redis only
        writer = RedisPrefixIndex(alternative_redis.url, block_size=hasher.block_size, hash_algo=algo)
        reader = RedisPrefixIndex(alternative_redis.url, block_size=hasher.block_size, hash_algo=algo)
        stops += [writer.close, reader.close]
        for rank in fleet:
            writer.set_capacity(rank.name, None)
            reader.set_capacity(rank.name, None)
        probe = Probe()
        probes = [subscribe(rank, probe, hasher) for rank in fleet]
        writers = [subscribe(rank, writer, hasher) for rank in fleet]
        stops += [s.stop for s in probes + writers]
        feeds = {"A": list(gateways[0].kv_feeds), "B": list(gateways[1].kv_feeds)}
        clock = SeqClock({"probe": probes, **feeds, "shared writer": writers}).start()
        stops.append(clock.stop)
        views: dict[str, PrefixIndex] = {"A": routers[0].index, "B": routers[1].index, "shared": reader}
        watch = Watch(probe, views).start()
        commands = redis_commands(shared_redis)
        writes = [int(str(router.index.stats().get("redis_full_writes", 0))) for router in routers]
        started = time.perf_counter()
        urls = [r.url for r in replicas]
        with ThreadPoolExecutor(args.concurrency) as pool:
            failed = sum(pool.map(lambda s: converse(urls, s, args.turns, args.tokens), range(args.sessions)))
        elapsed = time.perf_counter() - started
        watch.stop()
        applied = [sum(feed.mirror.applied for feed in feeds[name]) for name in ("A", "B")]
        wrote = [
            int(str(router.index.stats().get("redis_full_writes", 0))) - w
            for router, w in zip(routers, writes, strict=True)
        ]
        commands = redis_commands(shared_redis) - commands
        clock.stop()
        probe_events = sum(s.mirror.applied for s in probes)
        applying = {
            name: {"batches": len(lags), "p50": median(lags) * 1e3, "p99": percentile(lags, 99) * 1e3}
            for name, lags in clock.lags().items()
        }
        return {
            "ranks": args.ranks,
            "sessions": args.sessions,
            "turns": args.turns,
            "requests": args.sessions * args.turns,
            "failed": failed,
            "seconds": elapsed,
            "events": probe_events,
            "applied": dict(zip(("A", "B"), applied, strict=True)),
            "chains_written_to_redis": dict(zip(("A", "B"), wrote, strict=True)),
            "redis_commands_per_request": commands / (args.sessions * args.turns),
            "apply_lag_ms": applying,
            **watch.summary(),
        }
    finally:
        for stop in reversed(stops):
            stop()
        shared_redis.stop()
        alternative_redis.stop()
        stop_fleet(fleet)


def report(result: dict[str, Any]) -> None:
    print(
        f"{result['requests']} requests ({result['failed']} failed) over {result['ranks']} ranks in "
        f"{result['seconds']:.1f} s; {result['events']} KV events published"
    )
    print("batches applied, behind the first subscriber to apply each (ms):")
    for name, lag in result["apply_lag_ms"].items():
        print(f"  {name:<14}{lag['batches']:>7} batches   p50 {lag['p50']:>7.2f}   p99 {lag['p99']:>7.2f}")
    print("a block visible in each view (lookup), behind the probe's applying its event:")
    print(f"{'view':<10}{'stored p50':>12}{'p99':>9}{'removed p50':>13}{'p99':>9}{'unseen':>8}   (ms)")
    base = result["lag_ms"]["A"]["stored"]["p50"]
    for view in VIEWS:
        lag = result["lag_ms"][view]
        print(
            f"{view:<10}{lag['stored']['p50']:>12.2f}{lag['stored']['p99']:>9.2f}"
            f"{lag['removed']['p50']:>13.2f}{lag['removed']['p99']:>9.2f}{result['unseen'][view]:>8}"
            f"   stored p50 x{lag['stored']['p50'] / base:.1f} of A's"
        )
    agreement = ", ".join(
        f"{pair} {share:.4f}" for pair, share in result["agreement"].items() if share is not None
    )
    print(f"agreement over {result['samples']} sampled blocks: {agreement}")
    applied, wrote = result["applied"], result["chains_written_to_redis"]
    print(
        f"events applied: A {applied['A']}, B {applied['B']}; chains written to the shared Redis index: "
        f"A {wrote['A']}, B {wrote['B']}; Redis commands per request "
        f"{result['redis_commands_per_request']:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="", help="suffix of the JSON file's name")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2000, help="system prompt tokens (about)")
    parser.add_argument("--pool-tokens", type=int, default=16_000, help="each rank's KV pool: it evicts")
    parser.add_argument("--idle-ttl", type=float, default=2.0, help="--session-idle-ttl of the replicas")
    parser.add_argument("--time-scale", type=float, default=1.0, help="the sim ranks' model time scale")
    args = parser.parse_args()
    result = run(args)
    report(result)
    name = f"kv_event_lag{'-' + args.label if args.label else ''}.json"
    print(f"wrote {write_json(name, result)}")


if __name__ == "__main__":
    main()
