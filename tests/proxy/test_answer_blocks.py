"""The estimate counts the blocks the rank cached while decoding the previous answer (vLLM caches
decoded tokens' full blocks too): against simulated ranks, whose tokenizer prefixgate's default is,
estimated == reported cached tokens on every turn, and the index is never corrected."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from proxy.server import ServerThread
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers
from tokenization.prompt import PromptHead

SYSTEM = "You are a coding agent. Follow the repository's conventions. " * 20


def corrections(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("prefixgate_index_corrections_total{")
    )


@pytest.mark.parametrize("repeats", [7, 40], ids=["tail-on-the-path", "tail-on-the-loop"])
def test_previous_answers_blocks_are_in_the_estimate(rank_servers: RankServers, repeats: int) -> None:
    """A turn adding ~70 tokens is tokenized on its path; one adding ~300 goes on with the blocks it
    keeps while its tail is encoded on the event loop, and its estimate is as exact."""
    fleet = rank_servers.sim(2, kv_tokens=200_000)
    app = gateway_app(fleet)
    proxy = ServerThread(app).start()
    incremental = app.state.gateway.pipeline.blocks.incremental
    returning = incremental.returning_chat_blocks
    on_loop: list[bool] = []

    async def spied(body: Any, previous: Any, **options: Any) -> Any:
        got = await returning(body, previous, **options)
        on_loop.append(isinstance(got, PromptHead) and got.on_loop)
        return got

    incremental.returning_chat_blocks = spied
    try:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        estimates, reported = [], []
        with httpx.Client(timeout=30) as client:
            for turn in range(5):
                messages.append({"role": "user", "content": f"step {turn}: run the tests. " * repeats})
                body = {"model": "sim", "messages": messages, "max_tokens": 24 + turn}
                response = client.post(
                    proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "a"}
                )
                assert response.status_code == 200
                data = response.json()
                estimates.append(int(response.headers["x-prefixgate-estimated-cached-tokens"]))
                reported.append(data["usage"]["prompt_tokens_details"]["cached_tokens"])
                messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
        assert reported[1] > 0
        assert estimates == reported
        assert on_loop == [repeats == 40] * 4  # every returning turn
        assert corrections(proxy.url) == 0
    finally:
        proxy.stop()
