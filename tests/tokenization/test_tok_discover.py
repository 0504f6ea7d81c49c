"""``tokenization: {kind: auto}``: the served model's tokenizer, found from what the rank says."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any, Protocol

import orjson
from aiohttp import ClientSession, web

from tokenization.base import ChatPrompt, Encoded
from tokenization.config import TokenizerConfig
from tokenization.discover import Discovery, discover, model_directory
from tokenization.hf_tokenizer import HfTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer


class Encodes(Protocol):
    def encode_chat(self, prompt: ChatPrompt, prev: Encoded | None = None) -> Encoded: ...


def rank(root: str | None, tokenizer: Encodes | None, model: str = "served") -> web.Application:
    """A rank answering ``/v1/models`` (``root``) and, with ``tokenizer``, ``/tokenize`` in its ids."""

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/v1/models":
            card: dict[str, Any] = {"id": model, "object": "model"}
            if root is not None:
                card["root"] = root
            return web.json_response({"object": "list", "data": [card]})
        if request.path == "/tokenize" and tokenizer is not None:
            body = orjson.loads(await request.read())
            encoded = tokenizer.encode_chat(ChatPrompt(body["messages"], body.get("tools")))
            return web.json_response({"tokens": list(encoded.tokens)})
        return web.json_response({"detail": "Not Found"}, status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def run(app: web.Application, caches: list[Path] | None = None) -> Discovery:
    """What ``discover`` finds asking ``app``, served on a free loopback port for the call."""

    async def go() -> Discovery:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with ClientSession() as client:
                return await discover(
                    TokenizerConfig(), client, f"http://127.0.0.1:{port}", caches=caches or []
                )
        finally:
            await runner.cleanup()

    return asyncio.run(go())


def test_the_model_directory_named_by_root_checked_against_tokenize(hf_model_dir: Path) -> None:
    found = run(rank(str(hf_model_dir), HfTokenizer(hf_model_dir)))
    assert found.config.kind == "hf" and found.config.path == hf_model_dir and not found.warn
    assert "checked against the rank's /tokenize" in found.reason and str(hf_model_dir) in found.reason


def test_files_that_disagree_with_the_rank_are_not_used(hf_model_dir: Path) -> None:
    found = run(rank(str(hf_model_dir), TiktokenTokenizer()))
    assert found.config.kind == "tiktoken" and "agrees with the rank's /tokenize" in found.reason


def test_a_repository_in_the_hugging_face_cache(hf_model_dir: Path, tmp_path: Path) -> None:
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc123"
    shutil.copytree(hf_model_dir, snapshot)
    assert model_directory("org/tiny", [tmp_path / "hub"]) == snapshot
    assert model_directory("org/other", [tmp_path / "hub"]) is None
    found = run(rank("org/tiny", None), caches=[tmp_path / "hub"])
    assert found.config.kind == "hf" and found.config.path == snapshot and "not checked" in found.reason


def test_the_ranks_tokenize_when_no_files_and_another_tokenizer(hf_model_dir: Path) -> None:
    found = run(rank("meta/unknown-model", HfTokenizer(hf_model_dir)))
    assert found.config.kind == "backend" and "POST /tokenize" in found.reason and not found.warn
    assert found.model == "served"


def test_the_embedded_tokenizer_when_the_rank_says_nothing_with_a_warning() -> None:
    found = run(rank(None, None))
    assert found.config.kind == "tiktoken" and found.warn and "approximate" in found.reason

    async def ask_nobody() -> Discovery:
        async with ClientSession() as client:
            return await discover(TokenizerConfig(), client, None)

    nobody = asyncio.run(ask_nobody())
    assert nobody.config.kind == "tiktoken" and nobody.warn


def test_the_simulated_rank_speaks_the_embedded_tokenizer() -> None:
    found = run(rank("prefixgate-sim", TiktokenTokenizer()))
    assert found.config.kind == "tiktoken" and not found.warn
