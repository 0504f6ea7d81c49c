"""A minimal, fast OpenAI-compatible rank for proxy tests.

It answers instantly with fixed text, so a test through it sees the proxy, not the rank.
``StubBehavior`` switches on the failures tests need: slow or gated chunks, dying mid-stream,
hanging, error statuses, an unhealthy ``/health``. It records every request it receives.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

MODEL = "stub-model"


class StubDied(Exception):
    """Raised inside a streaming body to drop the connection mid-stream."""


@dataclass
class StubBehavior:
    chunks: int = 3  # content chunks per choice in a stream
    chunk_delay: float = 0.0
    die_after: int | None = None  # drop the connection after this many chunks
    hang: bool = False  # never answer completions
    status: int | None = None  # answer completions with this status and an error body
    healthy: bool = True
    gate: threading.Event | None = None  # streams wait here after their first chunk
    hold: threading.Event | None = None  # completions wait here before answering (unlike hang, releasable)
    record: bool = True  # keep every request in ``received`` (off for benchmarks)
    cache_details: bool = True  # report usage.prompt_tokens_details.cached_tokens
    received: list[dict[str, Any]] = field(default_factory=list)
    chunks_sent: int = 0
    streams_closed: int = 0  # streams that ended for any reason (finished, dropped, cancelled)


# The stub answers any prompt at once, so it says it holds any the benchmarks send (their 100k-token
# requests): with 8192 admission (issue 17) refused them 400 context_length_exceeded.
STUB_MAX_MODEL_LEN = 1_048_576


def _usage(prompt_tokens: int, completion_tokens: int, cache_details: bool = True) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        # A made-up figure: tests check it is relayed. Benchmarks turn it off (a rank without
        # --enable-prompt-tokens-details), since it would make prefixgate correct its index every request.
        **({"prompt_tokens_details": {"cached_tokens": prompt_tokens // 2}} if cache_details else {}),
    }


def create_stub_app(
    behavior: StubBehavior | None = None, name: str = "stub", model: str = MODEL
) -> Starlette:
    behavior = behavior or StubBehavior()

    async def completion(request: Request) -> Response:
        raw = await request.body()
        body = orjson.loads(raw)
        if behavior.record:
            behavior.received.append(
                {"headers": dict(request.headers), "body": body, "path": request.url.path}
            )
        if behavior.hang:
            await asyncio.sleep(3600)
        held = behavior.hold
        if held is not None:
            await asyncio.to_thread(held.wait, 30)
        if behavior.status is not None:
            error = {
                "error": {
                    "message": f"stub says {behavior.status}",
                    "type": "stub",
                    "param": None,
                    "code": None,
                }
            }
            return Response(orjson.dumps(error), status_code=behavior.status, media_type="application/json")
        chat = request.url.path.endswith("chat/completions")
        n = int(body.get("n") or 1)
        prompt_tokens = max(1, len(raw) // 4)
        obj_id = f"cmpl-{name}-{len(behavior.received)}"
        created = int(time.time())
        if not body.get("stream"):
            text = " ".join(["word"] * behavior.chunks)
            if chat:
                choices = [
                    {"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    for i in range(n)
                ]
                obj = "chat.completion"
            else:
                choices = [{"index": i, "text": text, "finish_reason": "stop"} for i in range(n)]
                obj = "text_completion"
            data = {
                "id": obj_id,
                "object": obj,
                "created": created,
                "model": body.get("model", model),
                "choices": choices,
                "usage": _usage(prompt_tokens, behavior.chunks * n, behavior.cache_details),
            }
            return Response(orjson.dumps(data), media_type="application/json")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            _stream(
                behavior, chat, n, obj_id, created, body.get("model", model), include_usage, prompt_tokens
            ),
            media_type="text/event-stream",
        )

    async def models(request: Request) -> Response:
        data = {
            "object": "list",
            "data": [{"id": model, "object": "model", "owned_by": name, "max_model_len": STUB_MAX_MODEL_LEN}],
        }
        return Response(orjson.dumps(data), media_type="application/json")

    async def tokenize(request: Request) -> Response:
        body = orjson.loads(await request.body())
        behavior.received.append({"headers": dict(request.headers), "body": body, "path": request.url.path})
        text = body.get("prompt") or orjson.dumps(body.get("messages")).decode()
        tokens = [ord(c) for c in text]
        return Response(
            orjson.dumps({"count": len(tokens), "max_model_len": STUB_MAX_MODEL_LEN, "tokens": tokens})
        )

    async def detokenize(request: Request) -> Response:
        body = orjson.loads(await request.body())
        return Response(orjson.dumps({"prompt": "".join(chr(t) for t in body.get("tokens", []))}))

    async def health(request: Request) -> Response:
        return Response(status_code=200 if behavior.healthy else 503)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", completion, methods=["POST"]),
            Route("/v1/completions", completion, methods=["POST"]),
            Route("/v1/models", models),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/health", health),
        ]
    )
    app.state.behavior = behavior
    return app


async def _stream(
    behavior: StubBehavior,
    chat: bool,
    n: int,
    obj_id: str,
    created: int,
    model: str,
    include_usage: bool,
    prompt_tokens: int,
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"
    sent = 0
    try:
        for step in range(behavior.chunks):
            for index in range(n):
                if behavior.die_after is not None and sent >= behavior.die_after:
                    raise StubDied()
                if chat:
                    delta: dict[str, Any] = {"content": f"word{step} "}
                    if step == 0:
                        delta["role"] = "assistant"
                    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": None}
                else:
                    choice = {"index": index, "text": f"word{step} ", "finish_reason": None}
                if step == behavior.chunks - 1:
                    choice["finish_reason"] = "stop"
                event = {"id": obj_id, "object": obj, "created": created, "model": model, "choices": [choice]}
                # Counted before the yield: once the client holds a chunk, the count includes it
                # (after the yield, the generator resumes only when the server asks for more).
                sent += 1
                behavior.chunks_sent += 1
                yield b"data: " + orjson.dumps(event) + b"\n\n"
                if sent == 1 and behavior.gate is not None:
                    await asyncio.to_thread(behavior.gate.wait, 30)
                if behavior.chunk_delay:
                    await asyncio.sleep(behavior.chunk_delay)
        if include_usage:
            usage = {
                "id": obj_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": _usage(prompt_tokens, behavior.chunks * n, behavior.cache_details),
            }
            yield b"data: " + orjson.dumps(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"
    finally:
        behavior.streams_closed += 1
