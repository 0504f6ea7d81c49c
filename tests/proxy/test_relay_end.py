"""The relay reports a stream's outcome before the chunk holding its last event goes out, and only
for the real last event: an answer whose text names the marker does not end it early."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import MappingProxyType
from typing import Any, cast

import orjson

from proxy.apis.messages import MessagesApi
from proxy.apis.responses import ResponsesApi
from proxy.stages.forward import Opened, RelayResponse, StreamOutcome
from routing.ranks import Rank


class _Connection:
    """What the relay uses of the rank's response."""

    status = 200
    headers = MappingProxyType({"content-type": "text/event-stream"})

    def release(self) -> None: ...

    def close(self) -> None: ...


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def _relay(chunks: list[bytes], marker: bytes) -> tuple[list[int], list[StreamOutcome]]:
    """Relay ``chunks``; returns, per chunk sent, how many outcomes were reported before it."""

    async def rest() -> AsyncIterator[bytes]:
        for chunk in chunks[1:]:
            yield chunk

    rank = Rank("r", "http://127.0.0.1:1", in_flight=1)
    opened = Opened(rank, cast(Any, _Connection()), first_chunk=chunks[0], chunks=rest())
    outcomes: list[StreamOutcome] = []
    reported_before: list[int] = []

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message["body"]:
            reported_before.append(len(outcomes))

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()  # the client never leaves
        return {}

    relay = RelayResponse(opened, {}, outcomes.append, lambda error: b"", None, marker)
    asyncio.run(relay({"type": "http"}, receive, send))
    return reported_before, outcomes


def test_messages_outcome_is_reported_before_message_stop_goes_out() -> None:
    text = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "event: message_stop"}}
    chunks = [
        _event("message_start", {"type": "message_start"}),
        _event("content_block_delta", text) + _event("content_block_delta", text),
        _event("message_delta", {"type": "message_delta", "usage": {"output_tokens": 3}}),
        _event("message_stop", {"type": "message_stop"}),
    ]
    reported_before, outcomes = _relay(chunks, MessagesApi.stream_end)
    assert reported_before == [0, 0, 0, 1], "reported with the last event, not with text naming it"
    assert len(outcomes) == 1 and outcomes[0].tail[-1] == chunks[-1]
    assert outcomes[0].error is None and not outcomes[0].disconnected


def test_responses_marker_in_the_first_chunk_and_at_a_chunk_start() -> None:
    done = _event("response.completed", {"type": "response.completed"})
    reported_before, outcomes = _relay([done], ResponsesApi.stream_end)
    assert reported_before == [1] and len(outcomes) == 1
    reported_before, outcomes = _relay(
        [_event("response.created", {"type": "response.created"}), done], ResponsesApi.stream_end
    )
    assert reported_before == [0, 1] and len(outcomes) == 1
