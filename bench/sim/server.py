"""The HTTP face of a simulated rank: vLLM's OpenAI-compatible API plus ``/sim/*`` controls.

``build_app`` assembles the endpoints: OpenAI completions and tokenize (``bench.sim.openai_api``),
Anthropic Messages and OpenAI Responses (``bench.sim.agent_apis``), and here the model card, health,
version, ``/metrics`` (``bench.sim.metrics``), ``/kv_event_sources``, the server and model info that
routers probe, and the ``/sim/*`` controls.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest

from bench.sim.agent_apis import add_agent_routes
from bench.sim.json_io import bad_request, json_response, read_json_object
from bench.sim.metrics import RankMetrics
from bench.sim.openai_api import add_openai_routes
from bench.sim.rank import SimRank
from bench.sim.record import RecordRequests


def build_app(rank: SimRank) -> FastAPI:
    """The FastAPI application serving ``rank``."""
    app = FastAPI(title=f"prefixgate simulated vLLM rank {rank.name}", docs_url=None, redoc_url=None)
    cfg = rank.config
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankMetrics(rank))
    add_openai_routes(app, rank)
    if cfg.record_path:
        app.add_middleware(RecordRequests, path=cfg.record_path)

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
        return json_response({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if rank.alive else 503)

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": "0.33.0+prefixgate.sim"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> Response:
        pub = rank.publisher
        if pub is None:
            return json_response([])
        return json_response(
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
        return json_response(server_info)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        return json_response(model_info)

    @app.post("/sim/faults")
    async def set_faults(request: Request) -> Response:
        try:
            new = await rank.faults.update(**await read_json_object(request))
        except (ValueError, TypeError) as exc:
            return bad_request(str(exc))
        return json_response(new.as_dict())

    @app.post("/sim/reset")
    @app.post("/reset_prefix_cache")
    async def reset() -> Response:
        ok = rank.engine.reset_prefix_cache()
        return json_response({"reset": ok}, 200 if ok else 409)

    @app.get("/sim/state")
    async def state() -> Response:
        return json_response(rank.state())

    add_agent_routes(app, rank)
    return app
