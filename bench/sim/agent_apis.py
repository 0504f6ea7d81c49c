"""The simulated rank's Anthropic Messages and OpenAI Responses endpoints.

Each request is converted to chat messages by ``tokenization.chat_conversion`` (the functions prefixgate
uses too) and runs through the same engine as ``/v1/chat/completions``, so the prefix cache sees
exactly the tokens a chat request with those messages would give. Answers and SSE events have the
shapes vLLM gives them: Anthropic ``message_start`` ... ``message_stop`` with
``usage.cache_read_input_tokens`` (``input_tokens`` = prompt - cache read); Responses
``response.created`` ... ``response.completed`` with ``usage.input_tokens_details.cached_tokens``.
Responses are stored (bounded, least recently used dropped) for ``previous_response_id`` and
``GET /v1/responses/{id}``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Scope

from bench.sim.connection import drop_connection, wait_finished
from bench.sim.json_io import json_response, openai_error, read_json_object
from bench.sim.prompts import Prompt
from bench.sim.rank import SimRank
from bench.sim.scripted import (
    Script,
    anthropic_block,
    anthropic_events,
    responses_events,
    responses_item,
    script_for,
)
from bench.sim.sequences import OUTPUT_TOKEN_TEXT, OutQueue, RequestTooLarge, SimRequest
from tokenization.chat_conversion import ConversionError, anthropic_to_chat, responses_to_chat
from tokenization.lru import LRU

#: Responses kept for ``previous_response_id`` per rank.
STORE_CAPACITY = 4096
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


@dataclass(slots=True)
class _Stored:
    messages: list[dict[str, Any]]  # the conversation, this response's output included
    response: dict[str, Any]


def anthropic_error(message: str, status: int, kind: str = "invalid_request_error") -> Response:
    """An Anthropic-shaped error body: ``{"type": "error", "error": {type, message}}``."""
    return json_response({"type": "error", "error": {"type": kind, "message": message}}, status)


def responses_error(message: str, status: int, param: str | None = None) -> Response:
    """An OpenAI Responses error: ``invalid_request_error`` below 500, ``server_error`` from 500."""
    return openai_error(message, status, "invalid_request_error" if status < 500 else "server_error", param)


def _event(name: str, data: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


class AgentApis:
    """The two APIs' handlers over one rank."""

    def __init__(self, rank: SimRank) -> None:
        self.rank = rank
        self.store: LRU[str, _Stored] = LRU(STORE_CAPACITY)  # one entry per unit of budget

    # -- shared ----------------------------------------------------------------------------------
    def prompt(self, chat: dict[str, Any]) -> Prompt:
        messages = chat["messages"]
        if not messages:
            raise ValueError("messages must contain at least one item")
        salt = chat.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        return self.rank.processor.chat(messages, chat.get("tools"), True, salt)

    def submit(
        self, chat: dict[str, Any], max_tokens: Any
    ) -> tuple[list[SimRequest], OutQueue, Script | None]:
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError("max_tokens must be a positive integer")
        script = script_for(chat, self.rank.config.scripted_tool_calls, self.rank.config.scripted_subagents)
        tokens = script.token_ids if script is not None else None
        reqs, out = self.rank.engine.submit(
            self.prompt(chat), max_tokens, 1, cache_salt=chat.get("cache_salt"), script=tokens
        )
        return reqs, out, script

    def cached(self, req: SimRequest) -> int | None:
        if not self.rank.config.enable_prompt_tokens_details:
            return None
        return max(req.num_cached_tokens, 0)

    async def collect(self, request: Request, reqs: list[SimRequest], out: OutQueue) -> str | None:
        """The generated text, or None when the client went away first."""
        if not await wait_finished(request, self.rank.engine, reqs, out):
            return None
        return "".join(OUTPUT_TOKEN_TEXT[t] for t in reqs[0].output_token_ids)

    async def tokens(self, scope: Scope, out: OutQueue) -> AsyncIterator[str]:
        """The generated token texts as they come; drops the connection on ``die_after_chunks``."""
        limit = self.rank.faults.config.die_after_chunks
        sent = 0
        while True:
            if limit is not None and sent >= limit:
                await drop_connection(scope)
                return
            _, token, finish = await out.get()
            yield OUTPUT_TOKEN_TEXT[token]
            sent += 1
            if finish is not None:
                return

    # -- Anthropic Messages ----------------------------------------------------------------------
    def anthropic_usage(self, req: SimRequest, output_tokens: int) -> dict[str, Any]:
        cached = self.cached(req)
        usage: dict[str, Any] = {"input_tokens": req.num_prompt_tokens - (cached or 0)}
        if cached is not None:
            usage["cache_creation_input_tokens"] = 0
            usage["cache_read_input_tokens"] = cached
        usage["output_tokens"] = output_tokens
        return usage

    async def messages(self, request: Request) -> Response:
        try:
            data = await read_json_object(request)
        except ValueError as exc:
            return anthropic_error(f"invalid JSON body: {exc}", 400)
        if await self.rank.faults.before_request():
            return anthropic_error("simulated failure (fault: error_rate)", 500, "api_error")
        try:
            if not isinstance(data.get("model"), str) or not data["model"]:
                raise ValueError("model is required")
            chat = anthropic_to_chat(data)
            reqs, out, script = self.submit(chat, data.get("max_tokens"))
        except (ValueError, TypeError, ConversionError, RequestTooLarge) as exc:
            return anthropic_error(str(exc), 400)
        mid = f"msg_{uuid.uuid4().hex}"
        model = data["model"]
        call = script.call if script is not None else None
        if call is not None:
            if not await wait_finished(request, self.rank.engine, reqs, out):
                return Response(status_code=499)
            req = reqs[0]
            message = _anthropic_message(mid, model, [], None, self.anthropic_usage(req, 0))
            usage = self.anthropic_usage(req, len(req.output_token_ids))
            if data.get("stream"):
                events = anthropic_events(call, message, usage)
                return StreamingResponse(iter(events), media_type="text/event-stream")
            return json_response(
                {**message, "content": [anthropic_block(call)], "stop_reason": "tool_use", "usage": usage}
            )
        if data.get("stream"):
            gen = self._anthropic_stream(request.scope, reqs, out, mid, model)
            return StreamingResponse(gen, media_type="text/event-stream")
        text = await self.collect(request, reqs, out)
        if text is None:
            return Response(status_code=499)
        req = reqs[0]
        stop = _STOP_REASONS.get(req.finish_reason or "stop", "end_turn")
        usage = self.anthropic_usage(req, len(req.output_token_ids))
        return json_response(_anthropic_message(mid, model, [{"type": "text", "text": text}], stop, usage))

    async def _anthropic_stream(
        self, scope: Scope, reqs: list[SimRequest], out: OutQueue, mid: str, model: str
    ) -> AsyncIterator[bytes]:
        req = reqs[0]
        try:
            started = False
            async for text in self.tokens(scope, out):
                if not started:
                    # vLLM's Messages stream converts its chat stream, whose first chunk comes after
                    # the prefill: its message_start does too
                    started = True
                    message = _anthropic_message(mid, model, [], None, self.anthropic_usage(req, 0))
                    yield _event("message_start", {"type": "message_start", "message": message})
                    block = {"type": "text", "text": ""}
                    yield _event(
                        "content_block_start",
                        {"type": "content_block_start", "index": 0, "content_block": block},
                    )
                delta = {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": text},
                }
                yield _event("content_block_delta", delta)
            if not req.finish_reason:
                return  # the connection was dropped (fault)
            yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            stop = _STOP_REASONS.get(req.finish_reason, "end_turn")
            yield _event(
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop, "stop_sequence": None},
                    "usage": self.anthropic_usage(req, len(req.output_token_ids)),
                },
            )
            yield _event("message_stop", {"type": "message_stop"})
        finally:
            self.rank.engine.abort(reqs)

    async def count_tokens(self, request: Request) -> Response:
        try:
            data = await read_json_object(request)
            chat = anthropic_to_chat(data)
            count = len(self.prompt(chat).token_ids)
        except (ValueError, TypeError, ConversionError) as exc:
            return anthropic_error(str(exc), 400)
        return json_response({"input_tokens": count, "context_management": {"original_input_tokens": count}})

    # -- OpenAI Responses ------------------------------------------------------------------------
    def responses_usage(self, req: SimRequest) -> dict[str, Any]:
        cached = self.cached(req)
        output = len(req.output_token_ids)
        return {
            "input_tokens": req.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": output,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": req.num_prompt_tokens + output,
        }

    async def responses(self, request: Request) -> Response:
        try:
            data = await read_json_object(request)
        except ValueError as exc:
            return responses_error(f"invalid JSON body: {exc}", 400)
        if await self.rank.faults.before_request():
            return responses_error("simulated failure (fault: error_rate)", 500)
        previous_id = data.get("previous_response_id")
        previous: _Stored | None = None
        if previous_id is not None:
            previous = self.store.get(previous_id) if isinstance(previous_id, str) else None  # now newest
            if previous is None:
                return responses_error(
                    f"Response with id '{previous_id}' not found.", 404, param="previous_response_id"
                )
        try:
            chat = responses_to_chat(data, previous.messages if previous is not None else None)
            max_tokens = data.get("max_output_tokens") or self.rank.config.default_max_tokens
            reqs, out, script = self.submit(chat, max_tokens)
        except (ValueError, TypeError, ConversionError, RequestTooLarge) as exc:
            return responses_error(str(exc), 400)
        response = {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "status": "in_progress",
            "model": data.get("model") or self.rank.config.model,
            "output": [],
            "instructions": data.get("instructions"),
            "previous_response_id": previous_id,
            "tools": data.get("tools") or [],
            "tool_choice": data.get("tool_choice", "auto"),
            "parallel_tool_calls": data.get("parallel_tool_calls", True),
            "store": data.get("store", True),
            "text": {"format": {"type": "text"}},
            "error": None,
            "incomplete_details": None,
            "metadata": data.get("metadata"),
            "usage": None,
        }
        call = script.call if script is not None else None
        if call is not None:
            if not await wait_finished(request, self.rank.engine, reqs, out):
                return Response(status_code=499)
            final = {
                **response,
                "status": "completed",
                "output": [responses_item(call)],
                "usage": self.responses_usage(reqs[0]),
            }
            if not data.get("stream"):
                return json_response(final)
            events = responses_events(call, response, final)
            return StreamingResponse(iter(events), media_type="text/event-stream")
        if data.get("stream"):
            gen = self._responses_stream(request.scope, reqs, out, response, chat["messages"])
            return StreamingResponse(gen, media_type="text/event-stream")
        text = await self.collect(request, reqs, out)
        if text is None:
            return Response(status_code=499)
        return json_response(
            self._finish(response, reqs[0], f"msg_{uuid.uuid4().hex}", text, chat["messages"])
        )

    def _finish(
        self,
        response: dict[str, Any],
        req: SimRequest,
        item_id: str,
        text: str,
        messages: list[dict[str, Any]],
    ) -> dict[str, Any]:
        response = {
            **response,
            "status": "completed",
            "output": [_output_message(item_id, text, "completed")],
            "usage": self.responses_usage(req),
        }
        if response["store"] is not False:
            stored = _Stored([*messages, {"role": "assistant", "content": text}], response)
            self.store.put(response["id"], stored)  # the least recently used one goes when full
        return response

    async def _responses_stream(
        self,
        scope: Scope,
        reqs: list[SimRequest],
        out: OutQueue,
        response: dict[str, Any],
        messages: list[dict[str, Any]],
    ) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            return _event(kind, {"type": kind, "sequence_number": seq - 1, **fields})

        item_id = f"msg_{uuid.uuid4().hex}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        try:
            # as vLLM's: these two at once, the output item with the first token (after the prefill)
            yield event("response.created", response=response)
            yield event("response.in_progress", response=response)
            part = {"type": "output_text", "text": "", "annotations": []}
            opened = event(
                "response.output_item.added",
                output_index=0,
                item=_output_message(item_id, "", "in_progress"),
            ) + event("response.content_part.added", part=part, **where)
            pieces: list[str] = []
            async for text in self.tokens(scope, out):
                if not pieces:
                    yield opened
                pieces.append(text)
                yield event("response.output_text.delta", delta=text, logprobs=[], **where)
            if not reqs[0].finish_reason:
                return  # the connection was dropped (fault)
            if not pieces:
                yield opened
            text = "".join(pieces)
            yield event("response.output_text.done", text=text, logprobs=[], **where)
            yield event("response.content_part.done", part={**part, "text": text}, **where)
            final = self._finish(response, reqs[0], item_id, text, messages)
            yield event("response.output_item.done", output_index=0, item=final["output"][0])
            yield event("response.completed", response=final)
        finally:
            self.rank.engine.abort(reqs)

    async def retrieve(self, response_id: str) -> Response:
        stored = self.store.peek(response_id)
        if stored is None:
            return responses_error(f"Response with id '{response_id}' not found.", 404)
        return json_response(stored.response)


def _anthropic_message(
    mid: str, model: str, content: list[dict[str, Any]], stop: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage,
    }


def _output_message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": []}] if text or status == "completed" else []
    )
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def add_agent_routes(app: FastAPI, rank: SimRank) -> AgentApis:
    """Serve ``/v1/messages``, ``/v1/messages/count_tokens``, ``/v1/responses`` and its retrieval."""
    apis = AgentApis(rank)
    app.add_api_route("/v1/messages", apis.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", apis.count_tokens, methods=["POST"])
    app.add_api_route("/v1/responses", apis.responses, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", apis.retrieve, methods=["GET"])
    return apis
