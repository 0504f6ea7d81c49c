"""prefixgate with its default settings (no tokenizer configured) in front of two real vLLM ranks:
it finds the served model's tokenizer and chat template itself (``tokenization.discover``: the
model directory vLLM names in ``/v1/models``' ``root``), so its estimates are exact."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import httpx
import pytest

from proxy.server import ServerThread
from tests.helpers.real_vllm import agent_turns, chat
from tests.vllm.ranks import VllmRank
from tokenization.config import TokenizerConfig
from tokenization.discover import Discovery, discover

THINK_S = 0.2


def test_discovery_finds_the_served_models_own_tokenizer(ranks: list[VllmRank], model_dir: Path) -> None:
    async def find() -> Discovery:
        async with aiohttp.ClientSession(trust_env=False) as client:
            return await discover(TokenizerConfig(), client, ranks[0].url, timeout=30.0)

    found = asyncio.run(find())
    assert found.config.kind == "hf" and found.config.path == model_dir, found.reason
    assert "checked against the rank's /tokenize" in found.reason


@pytest.mark.parametrize("kv_events", [False, True], ids=["history_index", "kv_event_index"])
def test_default_settings_estimates_equal_reported_cached_tokens(
    gateway: Callable[..., ServerThread], client: httpx.Client, nonce: str, kv_events: bool
) -> None:
    gw = gateway(kv_events=kv_events, defaults=True)
    results = []
    for messages, tools in agent_turns(nonce, 5):
        results.append(chat(client, gw.url, messages, tools, session=nonce))
        time.sleep(THINK_S)  # an agent thinks between turns: KV events have arrived by the next one
    assert all(r.estimated is not None for r in results), results
    assert results[-1].cached_tokens > 0, results
    assert [r.estimated for r in results] == [r.cached_tokens for r in results], results
