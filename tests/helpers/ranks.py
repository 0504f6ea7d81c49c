"""Ranks for the tests: one way to start N of them on loopback and stop them all afterwards.

Two kinds, each on a free port of 127.0.0.1:

- simulated vLLM ranks (``bench.sim.SimRankServer``): prefix cache, block pool, metrics, faults;
- stub ranks (``tests/helpers/stub_rank.py``): instant fixed answers, switchable failures, every
  request recorded.

The ``rank_servers`` fixture (tests/conftest.py) gives each test a ``RankServers`` built from its
suite's ``sim_config`` and ``stub_model`` fixtures; code that outlives one test (a module-scoped
fixture) uses ``RankServers`` as a context manager.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any

from bench.sim import FaultConfig, SimConfig, SimRankServer
from proxy.server import ServerThread
from tests.helpers.stub_rank import StubBehavior, create_stub_app


@dataclass
class StubRank:
    """A stub rank: ``behavior`` (what it does and what it received) served by ``server``."""

    name: str
    behavior: StubBehavior
    server: ServerThread
    app: Any

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        """Serve again on the same port (after ``stop``)."""
        self.server = ServerThread(self.app, port=self.server.port).start()


class RankServers:
    """Every rank one test starts: ``sim(n, **config)`` and ``stub(n, **behavior)`` return the new
    ranks, named ``sim-0``, ``sim-1``, ... and ``stub-0``, ... in start order across the test;
    ``stop_all()`` (or leaving the ``with`` block) stops each one.

    ``sim_config``: the simulated ranks' configuration, which ``sim``'s keyword arguments override
    (name and ports excepted: each rank gets its own). ``stub_model``: the model the stub ranks serve
    unless ``stub`` says otherwise; None serves ``model-<index>``.
    """

    def __init__(self, sim_config: SimConfig | None = None, stub_model: str | None = None) -> None:
        self.sim_config = sim_config or SimConfig()
        self.stub_model = stub_model
        self.sims: list[SimRankServer] = []
        self.stubs: list[StubRank] = []

    def sim(self, n: int, **config: Any) -> list[SimRankServer]:
        """Start ``n`` simulated ranks with ``sim_config`` and ``config`` (``SimConfig`` fields)."""
        ranks = []
        for _ in range(n):
            cfg = replace(self.sim_config, name=f"sim-{len(self.sims)}", **config)
            cfg = replace(cfg, faults=replace(cfg.faults))  # fault knobs change at run time: one copy each
            rank = SimRankServer(cfg)
            self.sims.append(rank)
            ranks.append(rank.start())
        return ranks

    def stub(self, n: int, model: str | None = None, **behavior: Any) -> list[StubRank]:
        """Start ``n`` stub ranks, each with its own ``StubBehavior(**behavior)``."""
        ranks = []
        for _ in range(n):
            index = len(self.stubs)
            b = StubBehavior(**behavior)
            name = f"stub-{index}"
            app = create_stub_app(b, name=name, model=model or self.stub_model or f"model-{index}")
            rank = StubRank(name, b, ServerThread(app).start(), app)
            self.stubs.append(rank)
            ranks.append(rank)
        return ranks

    def stop_all(self) -> None:
        """Stop every rank started, releasing what a fault or a gate holds so each stops promptly."""
        for rank in self.sims:
            if _faulty(rank):
                with contextlib.suppress(RuntimeError, TimeoutError):  # already stopped by the test
                    rank.clear_faults()  # releases hung requests
            rank.stop()
        for stub in self.stubs:
            for event in (stub.behavior.gate, stub.behavior.hold):
                if event is not None:
                    event.set()
            stub.stop()
        self.sims.clear()
        self.stubs.clear()

    def __enter__(self) -> RankServers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()


def _faulty(rank: SimRankServer) -> bool:
    """True when the rank runs with fault knobs set (at start or since, through ``set_faults``)."""
    try:
        return rank.rank.faults.config != FaultConfig()
    except RuntimeError:  # never started
        return False
