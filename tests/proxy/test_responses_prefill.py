"""A Responses stream's prefill is done at its first output event, not at its first chunk: vLLM's
stream sends ``response.created`` and ``response.in_progress`` before it awaits the engine, so the
prefill a request queued on its rank stays queued until the output begins."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from proxy.server import ServerThread
from proxy.stages.forward import past_preamble
from tests.helpers.gateway import gateway_app
from tests.helpers.wait import wait_until

PREAMBLE = frozenset({b"response.created", b"response.in_progress"})
PROMPT = "Read the repository and fix the failing test in the parser module, then explain. " * 40


def sse(kind: str, **fields: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def test_a_chunk_is_past_the_preamble_once_it_names_another_event() -> None:
    created, progress = sse("response.created"), sse("response.in_progress")
    delta = sse("response.output_text.delta", delta="hi")
    assert not past_preamble(created, PREAMBLE)
    assert not past_preamble(created + progress, PREAMBLE)
    assert past_preamble(created + progress + delta, PREAMBLE)  # all three in one read
    assert past_preamble(delta, PREAMBLE)
    assert past_preamble(b"event: response.outp", PREAMBLE)  # cut inside the output's name
    assert not past_preamble(b'data: {"text": "event: response.output_text.delta"}\n\n', PREAMBLE)
    assert past_preamble(created, frozenset())  # no preamble: any first chunk


class HeldResponsesRank:
    """A rank serving ``/v1/responses`` like vLLM: created and in_progress at once, then the output
    once ``output`` is set (its prefill, held by the test)."""

    name = "held"

    def __init__(self) -> None:
        self.output = threading.Event()

        async def responses(request: Request) -> Response:
            await request.body()

            async def events() -> AsyncIterator[bytes]:
                response = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
                yield sse("response.created", response=response)
                yield sse("response.in_progress", response=response)
                await asyncio.to_thread(self.output.wait, 30)
                yield sse("response.output_item.added", output_index=0, item={"type": "message"})
                yield sse("response.output_text.delta", delta="done", output_index=0)
                details = {"cached_tokens": 0}
                usage = {"input_tokens": 600, "output_tokens": 1, "input_tokens_details": details}
                completed = {**response, "status": "completed", "usage": usage}
                yield sse("response.completed", response=completed)

            return StreamingResponse(events(), media_type="text/event-stream")

        async def health(request: Request) -> Response:
            return Response("ok")

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "m", "max_model_len": 131072}]})

        app = Starlette(
            routes=[
                Route("/v1/responses", responses, methods=["POST"]),
                Route("/health", health),
                Route("/v1/models", models),
            ]
        )
        self.server = ServerThread(app).start()
        self.url = self.server.url


def test_a_responses_streams_prefill_stays_queued_until_its_output_begins() -> None:
    rank = HeldResponsesRank()
    app = gateway_app([rank], health_interval=0.2)
    proxy = ServerThread(app).start()
    try:
        router = app.state.gateway.router
        body = {"model": "m", "input": PROMPT, "stream": True, "max_output_tokens": 4}
        with (
            httpx.Client(base_url=proxy.url, timeout=30) as client,
            client.stream("POST", "/v1/responses", json=body) as response,
        ):
            lines = response.iter_lines()
            assert next(lines) == "event: response.created"  # the stream opened
            wait_until(lambda: router.inflight_tokens.get("held", 0) > 0, "the request was never charged")
            queued = router.queued_prefill.get("held", 0)
            assert queued > 0  # created and in_progress came: the prefill is still the rank's to do
            rank.output.set()
            events = [line for line in lines if line.startswith("event: ")]
            assert events[-1] == "event: response.completed"
        wait_until(lambda: router.queued_prefill.get("held", 0) == 0, "the prefill never left the queue")
    finally:
        rank.output.set()
        proxy.stop()
        rank.server.stop()
