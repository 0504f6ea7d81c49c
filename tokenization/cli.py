"""``prefixgate tokenize``: a request's token count, block count and block hashes, as the rank sees them."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import aiohttp
import orjson

from tokenization.base import UnsupportedRequest
from tokenization.block_hash import kv_event_hash
from tokenization.config import load_tokenizer_config, resolve_hash_algo
from tokenization.factory import build_incremental
from tokenization.prompt import PromptBlocks


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``prefixgate tokenize``."""
    parser.add_argument("--config", help="prefixgate YAML config; only its 'tokenization:' section is read")
    parser.add_argument("file", nargs="?", help="request JSON file (default: --input, else stdin)")
    parser.add_argument("--input", "-i", help="request JSON file, as FILE (default: stdin)")
    parser.add_argument("--block-size", type=int, help="override the block size (default: config, else 16)")
    parser.add_argument(
        "--hash-algo", help="override tokenization.hash_algo (auto here means vLLM's default, sha256)"
    )
    parser.add_argument("--backend-url", help="kind 'backend': the rank's base URL (POST /tokenize)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument("--tokens", action="store_true", help="also print the token ids")


def run(args: argparse.Namespace) -> int:
    """Tokenize one OpenAI chat or completion request body; 0 on success, 2 on bad input."""
    try:
        config = load_tokenizer_config(args.config)
        updates: dict[str, Any] = {}
        if args.block_size:
            updates["block_size"] = args.block_size
        if args.hash_algo:
            updates["hash_algo"] = args.hash_algo
        if updates:
            config = config.model_validate({**config.model_dump(), **updates})
        if args.file and args.input and args.file != args.input:
            raise ValueError(f"two request files given: {args.file} and --input {args.input}")
        path = args.file or args.input
        raw = open(path, "rb").read() if path else sys.stdin.buffer.read()  # noqa: SIM115
        body = orjson.loads(raw)
        if not isinstance(body, dict):
            raise UnsupportedRequest("the request must be a JSON object")
        blocks = asyncio.run(_blocks(config, body, args.backend_url))
    except (OSError, ValueError) as exc:  # pydantic's ValidationError and orjson's errors are ValueErrors
        print(f"prefixgate tokenize: {exc}", file=sys.stderr)
        return 2
    except (aiohttp.ClientError, TimeoutError) as exc:
        print(f"prefixgate tokenize: backend: {exc!r}", file=sys.stderr)
        return 2
    # auto prints vLLM's hashes here: the point of this command is comparing with a rank's.
    algo = resolve_hash_algo(config.hash_algo, compare_with_rank=True)
    _print(blocks, algo, as_json=args.json, with_tokens=args.tokens)
    return 0


async def _blocks(config: Any, body: dict[str, Any], backend_url: str | None) -> PromptBlocks:
    async with aiohttp.ClientSession() as client:
        inc = build_incremental(
            config,
            client=client,
            base_url=backend_url,
            model=body.get("model") if backend_url else None,
            compare_with_rank=True,
        )
        if "messages" in body:
            return await inc.blocks_for_chat(None, body)
        return await inc.blocks_for_completion(None, body)


def _print(blocks: PromptBlocks, algo: str, *, as_json: bool, with_tokens: bool) -> None:
    if as_json:
        out: dict[str, Any] = {
            "num_tokens": blocks.num_tokens,
            "block_size": blocks.block_size,
            "num_blocks": blocks.num_blocks,
            "hash_algo": algo,
            "block_hashes": [h.hex() for h in blocks.block_hashes],
            "kv_event_hashes": blocks.kv_event_hashes(),
            "parts": [list(p) for p in blocks.parts],
        }
        if with_tokens:
            out["tokens"] = blocks.tokens.tolist()
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
        return
    print(f"tokens: {blocks.num_tokens}")
    print(f"blocks: {blocks.num_blocks} (block size {blocks.block_size}, {algo})")
    for label, start, end in blocks.parts:
        print(f"part {label}: tokens {start}..{end}")
    for i, h in enumerate(blocks.block_hashes):
        print(f"{i:6d} {h.hex()} {kv_event_hash(h)}")
    if with_tokens:
        print("token ids:", " ".join(map(str, blocks.tokens)))
