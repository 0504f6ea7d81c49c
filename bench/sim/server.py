"""The HTTP face of a simulated rank: vLLM's OpenAI-compatible API plus ``/sim/*`` controls.

Response bodies and SSE chunks have the shape vLLM 0.33 gives them (ids, ``object``, ``created``,
``model``, ``choices[].finish_reason``, ``usage.prompt_tokens_details.cached_tokens``).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from bench.sim.config import SimConfig
from bench.sim.faults import DropConnection, Faults
from bench.sim.kv_events import KVEventPublisher
from bench.sim.prompts import Prompt, PromptProcessor
from bench.sim.scheduler import OUTPUT_TOKEN_TEXT, Engine, OutQueue, RequestTooLarge, SimRequest
from tokenization.encoding import chatml_encoding, decode

log = logging.getLogger(__name__)


class SimRank:
    """The in-process state of one rank: engine (pool, scheduler, counters), prompt caches, faults.

    Create and use it on the event loop that serves it.
    """

    def __init__(
        self, config: SimConfig, on_refuse_change: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        self.config = config
        self.name = config.name
        self.publisher: KVEventPublisher | None = None
        if config.kv_events:
            self.publisher = KVEventPublisher(
                host=config.host,
                port=config.kv_events_port,
                replay_port=config.kv_replay_port,
                topic=config.kv_events_topic,
                version=config.kv_events_version,
                data_parallel_rank=config.data_parallel_rank,
                buffer_steps=config.kv_events_buffer_steps,
            )
        self.engine = Engine(config, self.publisher.publish if self.publisher else None)
        self.pool = self.engine.pool
        self.counters = self.engine.counters
        self.processor = PromptProcessor(self.engine.hasher)
        chatml_encoding()  # built once per process (~0.2 s): not inside the first request's timing
        self.faults = Faults(config.faults, on_refuse_change)
        self.created = int(time.time())
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the engine's step loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self.engine.run(), name=f"{self.name}-engine")

    async def stop(self) -> None:
        self.engine.stop()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=5)
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)

    @property
    def alive(self) -> bool:
        return self._task is not None and not self._task.done()

    def state(self) -> dict[str, Any]:
        return {
            "name": self.name,
            **self.engine.state(),
            "faults": self.faults.config.as_dict(),
            "prompt_cache": {
                "segments_encoded": self.processor.segments_encoded,
                "blocks_hashed": self.processor.blocks_hashed,
            },
        }


# -- helpers -------------------------------------------------------------------------------------
def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def _error(message: str, status: int, kind: str) -> Response:
    return _json({"error": {"message": message, "type": kind, "param": None, "code": status}}, status)


def _bad_request(message: str) -> Response:
    return _error(message, 400, "BadRequestError")


async def _body(request: Request) -> dict[str, Any]:
    data = orjson.loads(await request.body())
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


_SEND_KEY = "prefixgate.sim.send"


def expose_connection(app: Any) -> Callable[..., Awaitable[None]]:
    """Wrap an ASGI app so that handlers can drop their connection (:func:`drop_connection`)."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[_SEND_KEY] = send
        await app(scope, receive, send)

    return wrapped


async def drop_connection(scope: dict[str, Any]) -> None:
    """Close the client's connection abruptly, after what was already sent, as a dying rank would.

    The transport comes from uvicorn's per-request ``send`` (see :func:`expose_connection`). Waiting
    for the write buffer keeps the chunks already yielded; ``abort`` then drops the unsent rest (the
    end of the chunked body included) and marks the connection lost so nothing more is written.
    """
    send = scope.get(_SEND_KEY)
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None:
        raise DropConnection("no transport to drop: run the app through expose_connection and uvicorn")
    for _ in range(2000):
        if transport.is_closing() or transport.get_write_buffer_size() == 0:
            break
        await asyncio.sleep(0.001)
    transport.abort()
    # Let connection_lost run: uvicorn then ignores the rest of the response instead of sending a 500.
    for _ in range(3):
        await asyncio.sleep(0)


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def wait_finished(request: Request, rank: SimRank, reqs: list[SimRequest], out: OutQueue) -> bool:
    """Wait until every sequence of ``reqs`` finished or the client went away; True when all finished.

    Either way the sequences are aborted afterwards (a no-op for finished ones), so a departed client's
    blocks are freed.
    """

    async def collect() -> None:
        pending = len(reqs)
        while pending:
            _, _, finish = await out.get()
            if finish is not None:
                pending -= 1

    collector = asyncio.ensure_future(collect())
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait([collector, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        collector.cancel()
        watcher.cancel()
        rank.engine.abort(reqs)
    return all(r.finish_reason for r in reqs)


class _MetricsCollector:
    def __init__(self, rank: SimRank) -> None:
        self.rank = rank

    def collect(self) -> Any:
        rank = self.rank
        cfg = rank.config
        labels = ["model_name", "engine"]
        values = [cfg.model, "0"]
        c = rank.counters
        engine = rank.engine

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            c.prefix_cache_hits,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", rank.pool.usage()
        )
        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running)
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting)
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.num_preemptions
        )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
            ],
        )
        info.add_metric([str(cfg.block_size), "auto", "True", str(cfg.total_blocks), cfg.hash_algo], 1.0)
        yield info


def _usage(rank: SimRank, reqs: list[SimRequest]) -> dict[str, Any]:
    prompt = reqs[0].num_prompt_tokens
    completion = sum(len(r.output_token_ids) for r in reqs)
    details = (
        {"cached_tokens": max(reqs[0].num_cached_tokens, 0)}
        if rank.config.enable_prompt_tokens_details
        else None
    )
    return {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": details,
    }


def _text(req: SimRequest) -> str:
    return "".join(OUTPUT_TOKEN_TEXT[t] for t in req.output_token_ids)


# -- the app -------------------------------------------------------------------------------------
def build_app(rank: SimRank) -> FastAPI:
    """The FastAPI application serving ``rank``."""
    app = FastAPI(title=f"prefixgate simulated vLLM rank {rank.name}", docs_url=None, redoc_url=None)
    cfg = rank.config
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_MetricsCollector(rank))  # type: ignore[arg-type]

    def prompt_of(kind: str, data: dict[str, Any]) -> Prompt:
        salt = data.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError("cache_salt must be a string")
        if kind == "chat":
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
            kwargs = data.get("chat_template_kwargs") or {}
            add_gen = data.get("add_generation_prompt", kwargs.get("add_generation_prompt", True))
            return rank.processor.chat(messages, data.get("tools"), bool(add_gen), salt)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return rank.processor.text(prompt, salt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return rank.processor.token_ids(prompt, salt)
        raise ValueError("prompt must be a string or a list of token ids (one prompt per request)")

    async def inference(request: Request, kind: str) -> Response:
        try:
            data = await _body(request)
        except ValueError as exc:
            return _bad_request(f"invalid JSON body: {exc}")
        if await rank.faults.before_request():
            return _error(
                "simulated failure (fault: error_rate)",
                rank.faults.config.error_status,
                "InternalServerError",
            )
        stream = bool(data.get("stream", False))
        if not stream and rank.faults.config.die_after_chunks == 0:
            await drop_connection(request.scope)
            return Response(status_code=500)  # never sent: the connection is gone
        try:
            prompt = prompt_of(kind, data)
            max_tokens = data.get("max_completion_tokens") or data.get("max_tokens") or cfg.default_max_tokens
            n = data.get("n") or 1
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise ValueError("max_tokens must be a positive integer")
            if not isinstance(n, int) or n < 1:
                raise ValueError("n must be a positive integer")
            reqs, out = rank.engine.submit(
                prompt,
                max_tokens,
                n,
                cache_salt=data.get("cache_salt"),
                skip_prefix_cache=data.get("prompt_logprobs") is not None,
            )
        except (ValueError, TypeError, RequestTooLarge) as exc:
            return _bad_request(str(exc))
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        rid = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        model = data.get("model") or cfg.model
        if stream:
            opts = data.get("stream_options") or {}
            include_usage = cfg.force_include_usage or bool(opts.get("include_usage"))
            gen = _stream(request.scope, rank, kind, reqs, out, rid, created, model, include_usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _complete(request, rank, kind, reqs, out, rid, created, model)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await inference(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await inference(request, "completion")

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "id": cfg.model,
            "object": "model",
            "created": rank.created,
            "owned_by": "vllm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if rank.alive else 503)

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": "0.33.0+prefixgate.sim"})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        try:
            data = await _body(request)
            prompt = prompt_of("chat" if "messages" in data else "completion", data)
        except ValueError as exc:
            return _bad_request(str(exc))
        tokens = prompt.token_ids
        strs = [decode([t]) for t in tokens] if data.get("return_token_strs") else None
        return _json(
            {"count": len(tokens), "max_model_len": cfg.max_model_len, "tokens": tokens, "token_strs": strs}
        )

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        try:
            data = await _body(request)
            tokens = data["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
                raise ValueError("tokens must be a list of token ids")
            return _json({"prompt": decode(tokens)})
        except (ValueError, KeyError) as exc:
            return _bad_request(str(exc))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        pub = rank.publisher
        if pub is None:
            return _json([])
        return _json(
            [
                {
                    "data_parallel_rank": cfg.data_parallel_rank,
                    "endpoint": pub.endpoint,
                    "replay_endpoint": pub.replay_endpoint,
                    "topic": cfg.kv_events_topic,
                }
            ]
        )

    server_info = {
        "model_path": cfg.model,
        "served_model_name": cfg.model,
        "tokenizer_path": "cl100k_base+chatml",
        "context_length": cfg.max_model_len,
        "max_total_num_tokens": (cfg.total_blocks - 1) * cfg.block_size,
        "page_size": cfg.block_size,
        "max_running_requests": cfg.max_num_seqs,
        "chunked_prefill_size": cfg.max_num_batched_tokens,
        "disaggregation_mode": "null",
        "dp_size": 1,
        "tp_size": 1,
        "version": "prefixgate-sim",
    }
    model_info = {"model_path": cfg.model, "tokenizer_path": "cl100k_base+chatml", "is_generation": True}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        return _json(server_info)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return _json(model_info)

    @app.post("/sim/faults")
    async def set_faults(request: Request) -> Response:
        try:
            new = await rank.faults.update(**await _body(request))
        except (ValueError, TypeError) as exc:
            return _bad_request(str(exc))
        return _json(new.as_dict())

    @app.post("/sim/reset")
    @app.post("/reset_prefix_cache")
    async def reset() -> Response:
        ok = rank.engine.reset_prefix_cache()
        return _json({"reset": ok}, 200 if ok else 409)

    @app.get("/sim/state")
    async def state() -> Response:
        return _json(rank.state())

    from bench.sim.agent_apis import add_agent_routes  # it imports this module's helpers

    add_agent_routes(app, rank)
    return app


async def _complete(
    request: Request,
    rank: SimRank,
    kind: str,
    reqs: list[SimRequest],
    out: OutQueue,
    rid: str,
    created: int,
    model: str,
) -> Response:
    if not await wait_finished(request, rank, reqs, out):
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
        "usage": _usage(rank, reqs),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }
    return _json(body)


_MALFORMED = b'data: {"id": "sim-malformed", "choices": [{"delta": {"content": \n\n'


async def _stream(
    scope: dict[str, Any],
    rank: SimRank,
    kind: str,
    reqs: list[SimRequest],
    out: OutQueue,
    rid: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    chat = kind == "chat"
    obj = "chat.completion.chunk" if chat else "text_completion"
    dumps = orjson.dumps
    faults = rank.faults
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
        if chat:
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
        pending = len(reqs)
        while pending:
            if malformed and sent:
                malformed = False
                yield _MALFORMED
            index, token, finish = await out.get()
            if finish is not None:
                pending -= 1
            text = OUTPUT_TOKEN_TEXT[token]
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
            yield chunk([], usage=_usage(rank, reqs))
        yield b"data: [DONE]\n\n"
    finally:
        rank.engine.abort(reqs)  # frees the blocks of sequences still running when the client left
