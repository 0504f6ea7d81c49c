"""The request's ending, told by the pipeline in order: a step that fails is logged and the steps after
it still run; a first turn answered before its whole prompt landed is told once it has, in order."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from bench.sim import SimRankServer
from proxy.gateway import Gateway
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers
from tests.proxy.test_first_turn_landing import LONG, SYSTEM, HeldTokenizer

SESSION = "ending"


class Running:
    """prefixgate in this process (its app driven through ASGI) before simulated ranks."""

    def __init__(self, ranks: list[SimRankServer], **flags: Any) -> None:
        self.app = gateway_app(ranks, **flags)
        self.gateway: Gateway = self.app.state.gateway
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://pg")

    async def chat(self, messages: list[dict[str, Any]]) -> httpx.Response:
        body = {"model": "prefixgate-sim", "messages": messages, "max_tokens": 4}
        response = await self.client.post(
            "/v1/chat/completions", json=body, headers={"x-session-id": SESSION}, timeout=30
        )
        assert response.status_code == 200, response.text
        return response


@pytest.fixture
async def running(rank_servers: RankServers) -> AsyncIterator[Running]:
    run = Running(rank_servers.sim(1), policy="prefix_affinity")
    await run.gateway.start()
    try:
        yield run
    finally:
        await run.client.aclose()
        await run.gateway.stop()


def steps_run(gateway: Gateway, rank: str) -> dict[str, bool]:
    """Whether each ending step with an effect to see ran for the one turn answered on ``rank``."""
    pipeline = gateway.pipeline
    assert pipeline is not None and gateway.router is not None
    local = gateway.locals.get(SESSION)
    session = gateway.sessions.get(SESSION)
    prompt = gateway.metrics.registry.get_sample_value("prefixgate_prompt_tokens_total", {"backend": rank})
    return {
        "usage": bool(prompt),
        "threads": local is not None and local.main.requests == 1,
        "admission": session is not None and session.prompt_tokens_sent > 0,
        "recorder": pipeline.recorder.total.requests == 1,
        "route": gateway.router.inflight_tokens[rank] == 0,
    }


def broken(name: str) -> Callable[..., None]:
    def fail(*args: object) -> None:
        raise RuntimeError(f"{name} broke")

    return fail


@pytest.mark.parametrize("step", ["threads", "admission", "recorder", "explainer", "route"])
async def test_a_failing_step_of_the_ending_is_logged_and_the_others_still_run(
    running: Running, step: str, caplog: pytest.LogCaptureFixture
) -> None:
    pipeline = running.gateway.pipeline
    assert pipeline is not None
    owner = getattr(pipeline, step)
    owner.finished = broken(step)  # this instance's step fails
    with caplog.at_level(logging.ERROR, logger="prefixgate.pipeline"):
        answer = await running.chat(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        )
    errors = [r for r in caplog.records if r.exc_info is not None]
    assert [str(r.exc_info[1]) for r in errors if r.exc_info] == [f"{step} broke"]
    assert errors[0].getMessage().endswith(" failed")
    ran = steps_run(running.gateway, answer.headers["x-prefixgate-backend"])
    assert {name for name, done in ran.items() if not done} == ({step} & ran.keys())


async def test_a_turn_answered_before_its_prompt_landed_is_told_in_order_once_it_landed(
    running: Running,
) -> None:
    pipeline = running.gateway.pipeline
    assert pipeline is not None
    told: list[str] = []

    def tell(owner: Any, name: str) -> None:
        step = getattr(owner, name)

        def told_then(*args: Any) -> None:
            told.append(f"{type(owner).__name__}.{name}")
            step(*args)

        setattr(owner, name, told_then)

    tell(pipeline.route, "prefilled")
    tell(pipeline.route, "landed")
    tell(pipeline.explainer, "routed")
    tell(pipeline.threads, "finished")
    tell(pipeline.route, "finished")
    incremental = pipeline.blocks.incremental
    assert incremental is not None
    held = HeldTokenizer(incremental.tokenizer)
    incremental.tokenizer = held
    try:
        await running.chat([SYSTEM, {"role": "user", "content": LONG * 2}])
        assert held.started.is_set() and not held.release.is_set()  # answered while still landing
        # answered whole: its prefill is done at once; the rest waits for the whole prompt
        assert told == ["Router.prefilled"]
    finally:
        held.release.set()
    for _ in range(3000):
        if len(told) == 5:
            break
        await asyncio.sleep(0.01)
    assert told == [
        "Router.prefilled",
        "Router.landed",
        "Explainer.routed",
        "Threads.finished",
        "Router.finished",
    ]
    local = running.gateway.locals.get(SESSION)
    assert local is not None and local.main.turn is not None and local.main.prompt is not None
    assert local.main.turn.num_tokens == len(local.main.prompt.encoded.tokens)  # the whole prompt
