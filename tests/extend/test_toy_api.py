"""A new client API is one module plus one registration line: this file is that module.

``EchoApi`` serves ``POST /v1/echo`` (``{"model", "text", "stream"}``), which no rank speaks: its
translation sends the rank a chat completion and turns the answer back into ``{"echo": ...}``. The
request still runs through every stage (session, blocks, admission, routing, observers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Literal

import httpx
import orjson
import pytest

from bench.sim import SimConfig, start_fleet, stop_fleet
from proxy import apis
from proxy.apis.base import Endpoint, NativeApi, Usage, check_stream_and_model, usage_of_json
from proxy.errors import bad_request
from proxy.ops.limits import Bounds
from tests.helpers.gateway import start_gateway


def _chat(body: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": body.get("model"),
        "messages": [{"role": "user", "content": body["text"]}],
        "max_tokens": 8,
    }


class EchoTranslation:
    def request(self, body: dict[str, Any]) -> bytes:
        return orjson.dumps({**_chat(body), "stream": bool(body.get("stream"))})

    def chunk(self, data: bytes) -> bytes:
        return data

    def body(self, data: bytes) -> bytes:
        answer = orjson.loads(data)
        return orjson.dumps({"echo": answer["choices"][0]["message"]["content"], "usage": answer["usage"]})

    def end(self) -> bytes:
        return b""


class EchoApi(NativeApi):
    """Errors in OpenAI's shape, nothing stored (``NativeApi``'s defaults); a translation of its own."""

    name = "echo"
    endpoints = (Endpoint("POST", "/v1/echo", "complete", "/v1/chat/completions"),)
    prompt_kind: Literal["chat", "text"] = "chat"

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        check_stream_and_model(body)
        if not isinstance(body.get("text"), str):
            raise bad_request("'text' must be a string", param="text")

    def head(self, body: dict[str, Any]) -> Any:
        return body["text"]

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        return body

    def prompt_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return _chat(body)

    def usage(self, data: Any) -> Usage | None:
        return usage_of_json(data)

    def translation(self) -> EchoTranslation:
        return EchoTranslation()


@pytest.fixture
def echo_api() -> Iterator[None]:
    apis.register(EchoApi())  # the one registration line
    yield
    apis.unregister("echo")


def test_a_registered_api_runs_through_every_stage(echo_api: None) -> None:
    ranks = start_fleet(2, SimConfig(time_scale=0))
    proxy = start_gateway(ranks, health_interval=0.5)
    try:
        text = "Summarize this repository's layout for a new contributor. " * 40
        first = httpx.post(
            proxy.url + "/v1/echo", json={"model": "sim", "text": text}, headers={"x-session-id": "e1"}
        )
        assert first.status_code == 200, first.text
        assert isinstance(first.json()["echo"], str) and first.json()["usage"]["prompt_tokens"] > 0
        assert first.headers["x-prefixgate-session"] == "e1"
        again = httpx.post(
            proxy.url + "/v1/echo", json={"model": "sim", "text": text}, headers={"x-session-id": "e1"}
        )
        assert again.headers["x-prefixgate-backend"] == first.headers["x-prefixgate-backend"]
        # the prompt view was tokenized and hashed: the second turn expects the first one's blocks
        assert int(again.headers["x-prefixgate-estimated-cached-tokens"]) > 0
        session = httpx.get(proxy.url + "/admin/sessions/e1").json()
        assert session["turns"] == 2 and session["hit_tokens_reported"] > 0  # admission observed both
        bad = httpx.post(proxy.url + "/v1/echo", json={"model": "sim", "text": 3})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text"
    finally:
        proxy.stop()
        stop_fleet(ranks)
