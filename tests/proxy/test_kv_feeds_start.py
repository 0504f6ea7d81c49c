"""Start-up subscribes to every rank's KV events at once: the ranks' replays overlap, so a fleet
waits for its slowest, not for their sum."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import zmq

from proxy.ops.metrics import Metrics
from proxy.stages.route import Router
from proxy.state.kv_feeds import KVFeeds, wait_caught_up
from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import END_SEQ
from routing.policies import make_policy
from routing.ranks import Fleet, Rank
from tokenization.block_hash import BlockHasher


class HeldReplays:
    """Replay sockets that answer no request until every rank's has arrived (then the end marker)."""

    def __init__(self, context: zmq.Context, ranks: int) -> None:
        self.sockets = [context.socket(zmq.ROUTER) for _ in range(ranks)]
        self.ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in self.sockets]
        self.publishers = [context.socket(zmq.PUB) for _ in range(ranks)]
        self.pub_ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in self.publishers]
        self.all_arrived = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        waiting: dict[int, list[bytes]] = {}
        while len(waiting) < len(self.sockets):
            ready = dict(poller.poll(10_000))
            if not ready:
                return  # a rank's request never came: its subscriber was never started
            for k, s in enumerate(self.sockets):
                if s in ready:
                    identity, *_ = s.recv_multipart()
                    waiting[k] = [identity]
        self.all_arrived = True
        for k, (identity,) in waiting.items():
            self.sockets[k].send_multipart([identity, b"", b"kv", END_SEQ, b""])

    def close(self) -> None:
        self._thread.join(15)
        for s in (*self.sockets, *self.publishers):
            s.close(0)


async def test_every_rank_replays_at_once(caplog: pytest.LogCaptureFixture) -> None:
    ranks = 3
    context = zmq.Context.instance()
    held = HeldReplays(context, ranks)
    fleet = Fleet(Rank(f"r{k}", f"http://127.0.0.1:{9000 + k}") for k in range(ranks))
    router = Router(fleet, make_policy("prefix_affinity"), MemoryPrefixIndex())
    spec = ",".join(
        f"r{k}=tcp://127.0.0.1:{held.pub_ports[k]}|tcp://127.0.0.1:{held.ports[k]}" for k in range(ranks)
    )
    caplog.set_level(logging.WARNING)
    # as the gateway starts them: every configured feed subscribes, then all are waited for at once
    feeds = KVFeeds(spec, router, BlockHasher(16, "sha256", "0"), Metrics()).start_configured()
    await asyncio.to_thread(wait_caught_up, feeds)
    try:
        held.close()
        # With one rank's replay awaited before the next rank subscribed, the first would have
        # given up (its replay got no answer in time) before the last one's request arrived.
        assert held.all_arrived
        assert all(feed.connected.is_set() for feed in feeds)
        assert not [r for r in caplog.records if "got no answer" in r.getMessage()], caplog.text
    finally:
        for feed in feeds:
            feed.stop()
