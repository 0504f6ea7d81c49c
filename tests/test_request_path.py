"""How far a streamed chat turn travels through the code: the distinct project modules it visits from
``Pipeline.handle`` to its last byte.

Issue 46 aims at 35 at most. Measured on this tree: 46 for a session's first turn, 41 for its next;
the bounds below are those figures, so the path cannot grow unnoticed, and are lowered as it shrinks.
What makes them up, first turn (next): the pipeline and its stages 8 (8), admission 5 (3) and the
state it keeps 4 (4), the tokenizer 5 (5), the prefix index, policy and ranks 7 (7), canonicalization
7 (4: a new system text runs the rules that apply to it, a known one is cached), and the API, context,
tenants, explainer and metrics 10 (10). Each stage is one module, stages 6 (route, pinned requests)
and 7 (forward and stream) too.

Measured, not timed: ``sys.setprofile`` over one streamed turn against a simulated rank, in this
process. A project function counts when it runs on the event loop inside the request: below
``Pipeline.handle`` or the relay of its answer in the request's own task, or in a task that the request
started (a prompt landing beside the request, what follows it). Background loops (health, metrics polls)
never count. Worker threads are not followed: these turns are short enough to be tokenized on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import httpx
import pytest

from bench.sim import SimRankServer
from proxy.pipeline import Pipeline
from proxy.stages.forward import RelayResponse
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers

ROOT = Path(__file__).resolve().parent.parent
#: Where the project's own code lives (``bench/`` serves the simulated rank, in its own thread).
PROJECT = tuple(str(ROOT / package) + "/" for package in ("proxy", "routing", "tokenization"))
#: The modules a session's first streamed turn visits, and its next turn (see the module docstring).
FIRST_TURN_MODULES = 46
NEXT_TURN_MODULES = 41

SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 20


class ModulesVisited:
    """The project modules whose functions run for one request (see the module docstring)."""

    def __init__(self, roots: set[CodeType]) -> None:
        self.roots = roots
        self.modules: set[str] = set()
        #: Tasks started from inside the request: everything they run is the request's.
        self.children: set[asyncio.Task[Any]] = set()

    def _inside(self, frame: FrameType | None) -> bool:
        while frame is not None:
            if frame.f_code in self.roots:
                return True
            frame = frame.f_back
        return False

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call" or not frame.f_code.co_filename.startswith(PROJECT):
            return
        try:
            task = asyncio.current_task()
        except RuntimeError:
            task = None
        if task in self.children or self._inside(frame):
            self.modules.add(frame.f_globals["__name__"])

    def task_factory(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        task = asyncio.Task(coro, loop=loop, **kwargs)
        parent = asyncio.current_task(loop)
        if parent in self.children or self._inside(sys._getframe(1)):
            self.children.add(task)
        return task

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        """Measure what runs inside the ``with`` block."""
        loop = asyncio.get_running_loop()
        loop.set_task_factory(self.task_factory)
        sys.setprofile(self.profile)
        try:
            yield
        finally:
            sys.setprofile(None)
            loop.set_task_factory(None)


@pytest.fixture
def rank(rank_servers: RankServers) -> SimRankServer:
    return rank_servers.sim(1, kv_tokens=200_000)[0]


async def streamed_turn(client: httpx.AsyncClient, messages: list[dict[str, Any]]) -> str:
    body = {"model": "prefixgate-sim", "messages": messages, "stream": True, "max_tokens": 8}
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"x-session-id": "measured"}
    ) as response:
        assert response.status_code == 200
        text = "".join([chunk async for chunk in response.aiter_text()])
    assert text.rstrip().endswith("data: [DONE]")
    return text


async def modules_of_turns(rank: SimRankServer) -> list[set[str]]:
    """The modules each of a session's first two streamed turns visits."""
    app = gateway_app([rank])
    gateway = app.state.gateway
    await gateway.start()
    roots = {Pipeline.handle.__code__, RelayResponse.__call__.__code__}
    visited = []
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://prefixgate") as client:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the test."}]
            for _ in range(2):
                measured = ModulesVisited(roots)
                with measured.watch():
                    await streamed_turn(client, messages)
                    await asyncio.gather(*measured.children, return_exceptions=True)
                visited.append(measured.modules)
                messages += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
    finally:
        await gateway.stop()
    return visited


async def test_a_streamed_chat_turn_visits_no_more_modules_than_measured(rank: SimRankServer) -> None:
    first, second = await modules_of_turns(rank)
    for modules, bound in ((first, FIRST_TURN_MODULES), (second, NEXT_TURN_MODULES)):
        # the measure sees the whole path: the stages, the rank's stream relayed, the ending
        assert {"proxy.pipeline", "proxy.stages.route", "proxy.stages.forward"} <= modules
        assert len(modules) <= bound, sorted(modules)
