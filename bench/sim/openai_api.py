"""The simulated rank's OpenAI endpoints as vLLM serves them: chat and text completions, tokenize.

Response bodies and SSE chunks have the shape vLLM 0.33 gives them (ids, ``object``, ``created``,
``model``, ``choices[].finish_reason``, ``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from starlette.types import Scope

from bench.sim.connection import drop_connection, wait_finished
from bench.sim.json_io import bad_request, json_response, openai_error, read_json_object
from bench.sim.prompts import Prompt
from bench.sim.rank import SimRank
from bench.sim.scripted import ToolCall, chat_chunks, chat_message, script_for
from bench.sim.sequences import OUTPUT_TOKEN_TEXT, OutQueue, RequestTooLarge, SimRequest
from tokenization.tiktoken_tokenizer import decode

_MALFORMED = b'data: {"id": "sim-malformed", "choices": [{"delta": {"content": \n\n'


class OpenAIApi:
    """``/v1/chat/completions``, ``/v1/completions``, ``/tokenize`` and ``/detokenize`` over one rank."""

    def __init__(self, rank: SimRank) -> None:
        self.rank = rank

    def prompt_of(self, kind: str, data: dict[str, Any]) -> Prompt:
        """The prompt of a ``chat`` or ``completion`` body; ``ValueError`` when it has none."""
        salt = data.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        processor = self.rank.processor
        if kind == "chat":
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
            kwargs = data.get("chat_template_kwargs") or {}
            add_gen = data.get("add_generation_prompt", kwargs.get("add_generation_prompt", True))
            return processor.chat(messages, data.get("tools"), bool(add_gen), salt)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return processor.text(prompt, salt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return processor.token_ids(prompt, salt)
        raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")

    async def chat_completions(self, request: Request) -> Response:
        return await self._inference(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._inference(request, "completion")

    async def tokenize(self, request: Request) -> Response:
        try:
            data = await read_json_object(request)
            prompt = self.prompt_of("chat" if "messages" in data else "completion", data)
        except ValueError as exc:
            return bad_request(str(exc))
        tokens = prompt.token_ids
        strs = [decode([t]) for t in tokens] if data.get("return_token_strs") else None
        max_model_len = self.rank.config.max_model_len
        return json_response(
            {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            data = await read_json_object(request)
            tokens = data["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("tokens must be a list of token ids")
            return json_response({"prompt": decode(tokens)})
        except (ValueError, KeyError) as exc:
            return bad_request(str(exc))

    async def _inference(self, request: Request, kind: str) -> Response:
        arrived_at = time.time()  # before the body is read and tokenized: when the rank got it
        rank = self.rank
        cfg = rank.config
        try:
            data = await read_json_object(request)
        except ValueError as exc:
            return bad_request(f"invalid JSON body: {exc}")
        if await rank.faults.before_request():
            return openai_error(
                "simulated failure (fault: error_rate)",
                rank.faults.config.error_status,
                "InternalServerError",
            )
        stream = bool(data.get("stream", False))
        if not stream and rank.faults.config.die_after_chunks == 0:
            await drop_connection(request.scope)
            return Response(status_code=500)  # never sent: the connection is gone
        try:
            prompt = self.prompt_of(kind, data)
            max_tokens = data.get("max_completion_tokens") or data.get("max_tokens") or cfg.default_max_tokens
            n = data.get("n") or 1
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError("max_tokens must be a positive integer")
            if not isinstance(n, int) or n < 1:
                raise ValueError("n must be a positive integer")
            script = (
                script_for(data, cfg.scripted_tool_calls, cfg.scripted_subagents) if kind == "chat" else None
            )
            reqs, out = rank.engine.submit(
                prompt,
                max_tokens,
                n,
                cache_salt=data.get("cache_salt"),
                skip_prefix_cache=data.get("prompt_logprobs") is not None,
                script=script.token_ids if script is not None else None,
            )
        except (ValueError, TypeError, RequestTooLarge) as exc:
            return bad_request(str(exc))
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = data.get("model") or cfg.model
        opts = data.get("stream_options") or {}
        include_usage = cfg.force_include_usage or bool(opts.get("include_usage"))
        if script is not None and script.call is not None:
            return await self._call(
                request, reqs, out, script.call, rid, created, model, stream, include_usage
            )
        if stream:
            timing = arrived_at if cfg.report_timing else None
            gen = self._stream(request.scope, kind, reqs, out, rid, created, model, include_usage, timing)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await self._complete(request, kind, reqs, out, rid, created, model)

    async def _call(
        self,
        request: Request,
        reqs: list[SimRequest],
        out: OutQueue,
        call: ToolCall,
        rid: str,
        created: int,
        model: str,
        stream: bool,
        include_usage: bool,
    ) -> Response:
        """A scripted answer calling a tool (``bench.sim.scripted``), once the rank generated it."""
        if not await wait_finished(request, self.rank.engine, reqs, out):
            return Response(status_code=499)
        usage = self._usage(reqs)
        if stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
            chunks = chat_chunks(call, head, usage if include_usage else None)
            return StreamingResponse(iter(chunks), media_type="text/event-stream")
        choice = {"index": 0, "message": chat_message(call), "logprobs": None, "finish_reason": "tool_calls"}
        body = {"id": rid, "object": "chat.completion", "created": created, "model": model}
        return json_response({**body, "choices": [choice], "usage": usage})

    def _usage(self, reqs: list[SimRequest]) -> dict[str, Any]:
        prompt = reqs[0].num_prompt_tokens
        completion = sum(len(r.output_token_ids) for r in reqs)
        details = (
            {"cached_tokens": max(reqs[0].num_cached_tokens, 0)}
            if self.rank.config.enable_prompt_tokens_details
            else None
        )
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": details,
        }

    async def _complete(
        self,
        request: Request,
        kind: str,
        reqs: list[SimRequest],
        out: OutQueue,
        rid: str,
        created: int,
        model: str,
    ) -> Response:
        if not await wait_finished(request, self.rank.engine, reqs, out):
            return Response(status_code=499)  # the client is gone; nobody reads this
        if kind == "chat":
            choices: list[dict[str, Any]] = [
                {
                    "index": r.index,
                    "message": {
                        "role": "assistant",
                        "content": _text(r),
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": None,
                }
                for r in reqs
            ]
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": r.index,
                    "text": _text(r),
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
                for r in reqs
            ]
            obj = "text_completion"
        body: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": self._usage(reqs),
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
        return json_response(body)

    async def _stream(
        self,
        scope: Scope,
        kind: str,
        reqs: list[SimRequest],
        out: OutQueue,
        rid: str,
        created: int,
        model: str,
        include_usage: bool,
        arrived_at: float | None = None,
    ) -> AsyncIterator[bytes]:
        """The SSE stream of a request's tokens; with ``arrived_at`` (``report_timing``) its usage
        chunk also carries ``sim_timing``."""
        chat = kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        dumps = orjson.dumps
        faults = self.rank.faults
        sent = 0

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            body = {"id": rid, "object": obj, "created": created, "model": model, "choices": choices, **extra}
            return b"data: " + dumps(body) + b"\n\n"

        def must_die() -> bool:
            limit = faults.config.die_after_chunks
            return limit is not None and sent >= limit

        malformed = faults.config.malformed_sse
        try:
            if must_die():
                await drop_connection(scope)
                return
            pending = len(reqs)
            # Like vLLM's chat stream, the role chunks go out on the engine's first output: after
            # the prefill, just before the first token (a client's first byte means prefill is done).
            roles = chat
            while pending:
                if malformed and sent:
                    malformed = False
                    yield _MALFORMED
                index, token, finish = await out.get()
                if roles:
                    roles = False
                    for r in reqs:
                        role = {
                            "index": r.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                        yield chunk([role])
                        sent += 1
                        if must_die():
                            await drop_connection(scope)
                            return
                if finish is not None:
                    pending -= 1
                text = OUTPUT_TOKEN_TEXT[token]
                choice: dict[str, Any]
                if chat:
                    choice = {
                        "index": index,
                        "delta": {"content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                else:
                    choice = {
                        "index": index,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                    }
                if finish is not None and chat:
                    choice["stop_reason"] = None
                yield chunk([choice])
                sent += 1
                if must_die():
                    await drop_connection(scope)
                    return
            if include_usage:
                extra = {"sim_timing": sim_timing(arrived_at, reqs[0])} if arrived_at is not None else {}
                yield chunk([], usage=self._usage(reqs), **extra)
            yield b"data: [DONE]\n\n"
        finally:
            self.rank.engine.abort(reqs)  # frees the blocks of sequences still running when the client left


def sim_timing(arrived_at: float, req: SimRequest) -> dict[str, float]:
    """When a request reached the rank and when it was first scheduled (a seat in the running batch
    and its first blocks), both as ``time.time()`` so that a client on the same machine can set them
    against its own send time. ``scheduled_at`` is the engine's monotonic clock, moved onto the wall
    clock's."""
    scheduled_wall = time.time() - (time.monotonic() - req.scheduled_at)
    return {"arrived_at": arrived_at, "scheduled_at": scheduled_wall}


def _text(req: SimRequest) -> str:
    return "".join(OUTPUT_TOKEN_TEXT[t] for t in req.output_token_ids)


def add_openai_routes(app: FastAPI, rank: SimRank) -> OpenAIApi:
    """Serve ``/v1/chat/completions``, ``/v1/completions``, ``/tokenize`` and ``/detokenize``."""
    api = OpenAIApi(rank)
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", api.detokenize, methods=["POST"])
    return api
