"""backend mode: POST /tokenize on a tiny server started here (and on the simulated rank if present)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import uvicorn
from fastapi import FastAPI, Request, Response

from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until
from tokenization.backend_info import block_size_of, fetch_cache_config, parse_cache_config_info
from tokenization.backend_tokenizer import BackendTokenizeError, BackendTokenizer
from tokenization.block_hash import make_hasher
from tokenization.config import TokenizerConfig
from tokenization.factory import build_incremental
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer, encode, render

METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
    'prefix_caching_hash_algo="sha256_cbor"} 1.0\n'
)


def _app(seen: list[dict[str, Any]]) -> FastAPI:
    app = FastAPI()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Any:
        data = await request.json()
        seen.append(data)
        if data.get("model") != "tiny":
            return Response(status_code=404, content=b'{"error": "model"}')
        if "messages" in data:
            text = render(data["messages"], data.get("tools"), data.get("add_generation_prompt", True))
        else:
            text = data["prompt"]
        tokens = encode(text)
        return {"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(content=METRICS, media_type="text/plain")

    return app


@pytest.fixture
def tokenize_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    seen: list[dict[str, Any]] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(_app(seen), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()

    def started() -> bool:
        if server.started:
            return True
        assert thread.is_alive(), "tokenize server did not start"
        return False

    wait_until(started, "tokenize server did not start", timeout=10, interval=0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", seen
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


MESSAGES = [
    {"role": "system", "content": "Agent."},
    {"role": "user", "content": "Read the file main.py " * 20},
]
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


async def test_backend_blocks_equal_local_and_answers_are_cached(tokenize_server: tuple[str, list]) -> None:
    url, seen = tokenize_server
    async with aiohttp.ClientSession() as client:
        backend = BackendTokenizer(client, url, "tiny", cache_entries=8, timeout_s=5)
        remote = IncrementalTokenizer(backend, make_hasher("sha256", 16, "0"))
        local = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"))
        body = {"messages": MESSAGES, "tools": TOOLS}
        got = await remote.blocks_for_chat("s", body)
        want = await local.blocks_for_chat(None, body)
        assert list(got.tokens) == list(want.tokens) and list(got.block_hashes) == list(want.block_hashes)
        assert seen[-1] == {
            "model": "tiny",
            "messages": MESSAGES,
            "add_generation_prompt": True,
            "tools": TOOLS,
        }
        again = await remote.blocks_for_chat("s", body)
        assert backend.round_trips == 1 and again.reused_blocks == again.num_blocks
        longer = {"messages": [*MESSAGES, {"role": "assistant", "content": "ok"}], "tools": TOOLS}
        turn2 = await remote.blocks_for_chat("s", longer)
        assert backend.round_trips == 2 and turn2.reused_blocks > 0
        assert list(turn2.block_hashes) == list((await local.blocks_for_chat(None, longer)).block_hashes)
        completion = await remote.blocks_for_completion(None, {"prompt": "hello world " * 10})
        assert list(completion.tokens) == encode("hello world " * 10)
        assert seen[-1] == {"model": "tiny", "prompt": "hello world " * 10}


async def test_backend_errors_are_reported(tokenize_server: tuple[str, list]) -> None:
    url, _ = tokenize_server
    async with aiohttp.ClientSession() as client:
        with pytest.raises(BackendTokenizeError, match="HTTP 404"):
            await BackendTokenizer(client, url, "other").tokenize({"model": "other", "prompt": "x"})
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
        closed.close()
        with pytest.raises(BackendTokenizeError):
            await BackendTokenizer(client, dead, "tiny", timeout_s=2).tokenize(
                {"model": "tiny", "prompt": "x"}
            )


async def test_block_size_from_cache_config_info(tokenize_server: tuple[str, list]) -> None:
    url, _ = tokenize_server
    async with aiohttp.ClientSession() as client:
        info = await fetch_cache_config(client, url)
        assert info["prefix_caching_hash_algo"] == "sha256_cbor" and block_size_of(info) == 32
        inc = build_incremental(
            TokenizerConfig(kind="backend"),
            block_size=block_size_of(info),
            client=client,
            base_url=url,
            model="tiny",
        )
        assert inc.block_size == 32
        blocks = await inc.blocks_for_chat(None, {"messages": MESSAGES})
        assert blocks.num_blocks == blocks.num_tokens // 32
    assert parse_cache_config_info("vllm:num_requests_running 0\n") == {}
    assert block_size_of({"block_size": "x"}) is None


async def test_against_the_simulated_rank(rank_servers: RankServers) -> None:
    (rank,) = rank_servers.sim(1, hash_seed="0")
    async with aiohttp.ClientSession() as client:
        url = f"http://127.0.0.1:{rank.port}"
        info = await fetch_cache_config(client, url)
        cfg = TokenizerConfig(
            kind="backend", hash_algo=info.get("prefix_caching_hash_algo", "sha256"), hash_seed="0"
        )
        remote = build_incremental(
            cfg, block_size=block_size_of(info), client=client, base_url=url, model=rank.config.model
        )
        local = build_incremental(cfg.model_copy(update={"kind": "tiktoken"}), block_size=block_size_of(info))
        body = {"model": rank.config.model, "messages": MESSAGES, "tools": TOOLS}
        got, want = await remote.blocks_for_chat(None, body), await local.blocks_for_chat(None, body)
        assert list(got.tokens) == list(want.tokens)
        assert list(got.block_hashes) == list(want.block_hashes) and got.num_blocks > 0
