"""The fuzz tier: every field of the chat, completions, messages and responses bodies (hypothesis), and
raw-socket mutations of well-formed requests, against one prefixgate before a rank that answers
anything. prefixgate must answer each one (a 4xx with the API's error body, or the rank's answer):
never a 5xx, never an unhandled exception, and it keeps serving.

Every field, of the body and of the messages, items, parts and tools nested in it, draws from its
valid shapes and from any JSON value (wrong types included); the messages and items of each API
draw from every kind of part it knows. The counts are printed and
written to ``bench/out/fuzz_apis.json``; ``FUZZ_SCALE`` multiplies them (CI runs the default, at
least 10,000 inputs in a couple of minutes).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import socket
import string
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxy.server import ServerThread
from tests.helpers import fuzz_values
from tests.helpers.gateway import start_gateway

OUT = Path(__file__).resolve().parents[2] / "bench" / "out" / "fuzz_apis.json"
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
EXAMPLES = {"chat": 2200, "completions": 1200, "messages": 2000, "responses": 2000, "raw": 3000}
MODEL = "fuzz-model"
#: Seconds one fuzz test may take before the run is aborted with stack dumps (scaled with FUZZ_SCALE).
FUZZ_TEST_DEADLINE_S = 240.0 * max(SCALE, 1.0)
TRIED: Counter[str] = Counter()
STATUSES: Counter[str] = Counter()


def fuzz_settings(kind: str) -> settings:
    return settings(
        max_examples=max(1, int(EXAMPLES[kind] * SCALE)),
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )


# -- a rank that answers anything -------------------------------------------------------------------

CHAT_ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}},
}
STREAMS = {
    "/v1/chat/completions": [
        {"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "ok"}}]},
        {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": CHAT_ANSWER["usage"]},
    ],
    "/v1/completions": [{"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]}],
    "/v1/messages": [
        {"type": "message_start", "message": {"id": "m", "usage": {"input_tokens": 3, "output_tokens": 0}}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}},
        {"type": "message_delta", "usage": {"output_tokens": 1, "cache_read_input_tokens": 0}},
    ],
    "/v1/responses": [
        {"type": "response.output_text.delta", "delta": "ok"},
        {
            "type": "response.completed",
            "response": {"id": "resp_fuzz", "usage": {"input_tokens": 3, "output_tokens": 1}},
        },
    ],
}
WHOLE = {
    "/v1/chat/completions": CHAT_ANSWER,
    "/v1/completions": {**CHAT_ANSWER, "object": "text_completion", "choices": [{"index": 0, "text": "ok"}]},
    "/v1/messages": {
        "id": "m",
        "type": "message",
        "content": [],
        "usage": {"input_tokens": 3, "output_tokens": 1},
    },
    "/v1/messages/count_tokens": {"input_tokens": 3},
    "/v1/responses": {"id": "resp_fuzz", "object": "response", "output": [], "usage": {"input_tokens": 3}},
    "/tokenize": {"count": 1, "tokens": [1], "max_model_len": 8192},
    "/detokenize": {"prompt": "ok"},
}


async def answer(request: Request) -> Response:
    path = request.url.path
    if request.method == "GET":
        if path == "/v1/models":
            return Response(orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}))
        if path.startswith("/v1/responses/"):
            return Response(orjson.dumps(WHOLE["/v1/responses"]), media_type="application/json")
        return Response(b"{}", media_type="application/json")
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and body.get("stream") is True and path in STREAMS:
        events = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in STREAMS[path]) + b"data: [DONE]\n\n"
        return Response(events, media_type="text/event-stream")
    return Response(orjson.dumps(WHOLE.get(path, {})), media_type="application/json")


def tolerant_rank() -> ServerThread:
    routes = [Route("/{path:path}", answer, methods=["GET", "POST"])]
    return ServerThread(Starlette(routes=routes)).start()


@pytest.fixture(scope="module")
def target() -> Iterator[httpx.Client]:
    rank = tolerant_rank()
    proxy = start_gateway(
        [("fuzz-rank", rank.url)],
        retries=0,
        max_body_bytes=256 * 1024,
        max_json_depth=32,
        health_interval=5.0,
        header_timeout=2.0,
        body_timeout=2.0,
    )
    client = httpx.Client(base_url=proxy.url, timeout=15)
    try:
        yield client
        # still serving, and nothing went unhandled
        ok = client.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        )
        assert ok.status_code == 200
    finally:
        client.close()
        proxy.stop()
        rank.stop()
        write_report()


@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    """The suite's hang guard (conftest.py), sized for a test that sends a few thousand requests: the
    suite's 60 s is what one of them takes on a loaded 2-core machine."""
    faulthandler.dump_traceback_later(FUZZ_TEST_DEADLINE_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(autouse=True)
def no_unhandled_errors(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    caplog.set_level(logging.ERROR)
    yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR and not r.name.startswith("hypothesis")]
    assert not errors, [r.getMessage() for r in errors][:5]


def write_report() -> None:
    fuzz_values.write_counts(OUT, "fuzz tier", TRIED, STATUSES)


def check(response: httpx.Response, kind: str) -> None:
    TRIED[kind] += 1
    STATUSES[str(response.status_code)] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = orjson.loads(response.content)["error"]
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]


# -- strategies ------------------------------------------------------------------------------------

anything = fuzz_values.json_values(text_size=16, items=3, leaves=6)


def either(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's valid shapes most of the time, and any JSON value (a wrong type) otherwise."""
    return st.one_of(valid, valid, valid, anything)


def body(
    required: dict[str, Any], optional: dict[str, Any] | None = None
) -> st.SearchStrategy[dict[str, Any]]:
    """An object whose every field, nested parts' included, is sometimes of a wrong type."""
    return st.fixed_dictionaries(
        {k: either(v) for k, v in required.items()},
        optional={k: either(v) for k, v in (optional or {}).items()},
    )


text = st.text(max_size=40)
names = st.text(alphabet=string.ascii_letters + "_-", min_size=1, max_size=12)
session_keys = st.text(max_size=40) | st.text(alphabet=string.printable, max_size=300)
schema = body(
    {"type": st.sampled_from(["object", "string"]) | anything},
    optional={
        "properties": st.dictionaries(names, anything, max_size=3),
        "required": st.lists(names, max_size=2),
    },
)
roles = st.sampled_from(["system", "developer", "user", "assistant", "tool", "function"])
chat_part = body(
    {"type": st.sampled_from(["text", "image_url", "input_audio", "file"])},
    optional={"text": text, "image_url": body({"url": text})},
)
tool_call = body(
    {
        "id": names,
        "type": st.just("function"),
        "function": body({"name": names, "arguments": text}),
    }
)
chat_message = body(
    {"role": roles, "content": text | st.lists(either(chat_part), max_size=3) | st.none()},
    {
        "name": names,
        "tool_calls": st.lists(either(tool_call), max_size=2),
        "tool_call_id": names,
        "reasoning_content": text,
    },
)
chat_tool = body(
    {
        "type": st.just("function"),
        "function": body({"name": names}, {"description": text, "parameters": schema}),
    },
    {},
)
COMMON = {
    "stream": st.booleans(),
    "stream_options": body({}, optional={"include_usage": st.booleans()}),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "stop": text | st.lists(text, max_size=3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "user": session_keys,
    "cache_salt": text,
    "metadata": body({}, optional={"user_id": session_keys, "session_id": session_keys}),
}
chat_bodies = body(
    {"model": st.just(MODEL), "messages": st.lists(either(chat_message), max_size=6)},
    {
        **COMMON,
        "tools": st.lists(either(chat_tool), max_size=3),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "max_tokens": st.integers(-1, 64),
        "max_completion_tokens": st.integers(-1, 64),
        "prompt_cache_key": session_keys,
        "response_format": body({"type": st.sampled_from(["text", "json_object"])}),
        "reasoning_effort": st.sampled_from(["low", "medium", "high"]),
        "chat_template_kwargs": st.dictionaries(names, anything, max_size=2),
        "logprobs": st.booleans(),
        "parallel_tool_calls": st.booleans(),
    },
)
completion_bodies = body(
    {
        "model": st.just(MODEL),
        "prompt": text
        | st.lists(text, max_size=3)
        | st.lists(st.integers(0, 100_000), max_size=8)
        | st.lists(st.lists(st.integers(0, 100_000), max_size=4), max_size=3),
    },
    {
        **COMMON,
        "max_tokens": st.integers(-1, 64),
        "echo": st.booleans(),
        "suffix": text,
        "logprobs": st.integers(0, 5),
    },
)
anthropic_block = st.one_of(
    body({"type": st.just("text"), "text": text}, optional={"cache_control": st.just({"type": "ephemeral"})}),
    body(
        {
            "type": st.just("image"),
            "source": body(
                {"type": st.sampled_from(["base64", "url"])}, {"data": text, "url": text, "media_type": text}
            ),
        }
    ),
    body({"type": st.just("tool_use"), "id": names, "name": names, "input": anything}),
    body(
        {"type": st.just("tool_result"), "tool_use_id": names},
        optional={"content": text | st.lists(anything, max_size=2), "is_error": st.booleans()},
    ),
    body({"type": st.just("thinking"), "thinking": text}, optional={"signature": text}),
    body({"type": text}),
)
anthropic_message = body(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": text | st.lists(either(anthropic_block), max_size=4),
    },
    {},
)
message_bodies = body(
    {
        "model": st.just(MODEL),
        "max_tokens": st.integers(-1, 64),
        "messages": st.lists(either(anthropic_message), max_size=5),
    },
    {
        **COMMON,
        "system": text | st.lists(either(anthropic_block), max_size=3),
        "tools": st.lists(
            either(body({"name": names}, {"description": text, "input_schema": schema})), max_size=3
        ),
        "tool_choice": body(
            {"type": st.sampled_from(["auto", "any", "tool", "none"])}, optional={"name": names}
        ),
        "thinking": body(
            {"type": st.sampled_from(["enabled", "disabled"])},
            optional={"budget_tokens": st.integers(0, 4096)},
        ),
        "stop_sequences": st.lists(text, max_size=3),
        "top_k": st.integers(0, 100),
    },
)
response_part = body(
    {"type": st.sampled_from(["input_text", "output_text", "input_image", "refusal", "summary_text"])},
    optional={"text": text, "image_url": text},
)
response_item = st.one_of(
    body(
        {"role": roles, "content": text | st.lists(either(response_part), max_size=3)},
        {"type": st.just("message")},
    ),
    body(
        {"type": st.just("function_call"), "call_id": names, "name": names, "arguments": text}, {"id": names}
    ),
    body({"type": st.just("function_call_output"), "call_id": names, "output": text}, {}),
    body(
        {"type": st.just("reasoning")}, {"summary": st.lists(either(response_part), max_size=2), "id": names}
    ),
    body({"type": text}, {}),
)
response_bodies = body(
    {"model": st.just(MODEL), "input": text | st.lists(either(response_item), max_size=5)},
    {
        **COMMON,
        "instructions": text,
        "tools": st.lists(
            either(
                body(
                    {"type": st.sampled_from(["function", "web_search"]), "name": names},
                    {"description": text, "parameters": schema, "strict": st.booleans()},
                )
            ),
            max_size=3,
        ),
        "tool_choice": st.sampled_from(["auto", "none", "required"]),
        "previous_response_id": names,
        "store": st.booleans(),
        "max_output_tokens": st.integers(-1, 64),
        "reasoning": body({}, optional={"effort": st.sampled_from(["low", "high"]), "summary": text}),
        "text": body({}, optional={"format": body({"type": text})}),
        "prompt_cache_key": session_keys,
        "truncation": st.sampled_from(["auto", "disabled"]),
    },
)
header_values = st.text(alphabet=string.printable.strip() + " ", max_size=60).map(str.strip)
headers = st.dictionaries(
    st.sampled_from(
        ["x-session-id", "x-claude-code-session-id", "session-id", "x-task-id", "x-forwarded-for"]
    ),
    header_values,
    max_size=3,
)


def fuzz_api(target: httpx.Client, kind: str, path: str, bodies: st.SearchStrategy[dict[str, Any]]) -> None:
    @fuzz_settings(kind)
    @given(bodies, st.just({}) | headers)
    def run(body: dict[str, Any], extra: dict[str, str]) -> None:
        check(
            target.post(
                path, content=orjson.dumps(body), headers={"content-type": "application/json", **extra}
            ),
            kind,
        )

    run()


def test_chat_completions_fields(target: httpx.Client) -> None:
    fuzz_api(target, "chat", "/v1/chat/completions", chat_bodies)


def test_completions_fields(target: httpx.Client) -> None:
    fuzz_api(target, "completions", "/v1/completions", completion_bodies)


def test_messages_fields(target: httpx.Client) -> None:
    fuzz_api(target, "messages", "/v1/messages", message_bodies)


def test_responses_fields(target: httpx.Client) -> None:
    fuzz_api(target, "responses", "/v1/responses", response_bodies)


# -- raw-socket mutations ---------------------------------------------------------------------------

PATHS = ["/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/completions", "/tokenize", "/health"]


#: Well-formed bodies for the raw requests (the HTTP layer is what they fuzz, not the fields).
RAW_BODIES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    "/v1/messages": {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/responses": {"model": MODEL, "input": "hi", "stream": True},
    "/v1/completions": {"model": MODEL, "prompt": "hi"},
    "/tokenize": {"model": MODEL, "prompt": "hi"},
}


def request_bytes(method: str, path: str, heads: list[tuple[str, str]], payload: bytes) -> bytes:
    # connection: close: the server closes once it answered, so reading to the end never waits
    lines = [f"{method} {path} HTTP/1.1", "host: prefixgate", *(f"{k}: {v}" for k, v in heads)]
    return ("\r\n".join([*lines, "connection: close"]) + "\r\n\r\n").encode("latin-1") + payload


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A request's bytes and whether they may be incomplete (the server then waits for more)."""
    path = draw(st.sampled_from(PATHS))
    payload = orjson.dumps(RAW_BODIES[path]) if path in RAW_BODIES else b""
    method = draw(
        st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "OPTIONS", "HEAD", "PATCH", "BREW"])
    )
    heads = [("content-type", "application/json")]
    mutation = draw(
        st.sampled_from(
            [
                "none",
                "length",
                "two_lengths",
                "chunked",
                "chunked_and_length",
                "bad_chunk",
                "flip",
                "insert",
                "truncate",
                "header",
                "path",
                "version",
                "pipelined",
                "huge_header",
            ]
        )
    )
    may_hang = False
    if mutation == "length":
        delta = draw(st.integers(-len(payload), 64))
        heads.append(("content-length", str(len(payload) + delta)))
        may_hang = delta > 0
    elif mutation == "two_lengths":
        heads += [("content-length", str(len(payload))), ("content-length", str(draw(st.integers(0, 500))))]
        may_hang = True
    elif mutation in ("chunked", "chunked_and_length", "bad_chunk"):
        heads.append(
            ("transfer-encoding", draw(st.sampled_from(["chunked", "chunked, gzip", "identity", " chunked"])))
        )
        if mutation == "chunked_and_length":
            heads.append(("content-length", str(len(payload))))
        size = (
            f"{len(payload):x}"
            if mutation != "bad_chunk"
            else draw(st.sampled_from(["zz", "-1", "ffffffffffffffff", "", "1;ext=x"]))
        )
        payload = f"{size}\r\n".encode() + payload + b"\r\n0\r\n\r\n"
        may_hang = True
    else:
        heads.append(("content-length", str(len(payload))))
    data = request_bytes(method, path, heads, payload)
    if mutation == "flip" and data:
        index = draw(st.integers(0, len(data) - 1))
        data = data[:index] + bytes([draw(st.integers(0, 255))]) + data[index + 1 :]
        may_hang = True
    elif mutation == "insert":
        index = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"\r\n", b"\n", b"\x00", b" ", b":", b"\r\n\r\n", b"\xff\xfe"]))
        data = data[:index] + junk + data[index:]
        may_hang = True
    elif mutation == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
        may_hang = True
    elif mutation == "header":
        name = draw(st.text(alphabet=string.printable, min_size=1, max_size=20))
        value = draw(st.binary(max_size=40))
        data = data.replace(b"\r\n", b"\r\n" + name.encode() + b": " + value + b"\r\n", 1)
        may_hang = True
    elif mutation == "path":
        odd = draw(
            st.sampled_from(
                [
                    "//v1//chat",
                    "/v1/../admin/sessions",
                    "/%2e%2e/%00",
                    "http://evil/v1/models",
                    "*",
                    "/" + "a" * 9000,
                    "/v1/responses/%ff%fe",
                ]
            )
        )
        data = data.replace(path.encode(), odd.encode(), 1)
    elif mutation == "version":
        data = data.replace(
            b"HTTP/1.1", draw(st.sampled_from([b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9.9", b"HTTP/1.1x", b""])), 1
        )
        may_hang = True
    elif mutation == "pipelined":
        data = data + data
    elif mutation == "huge_header":
        data = data.replace(b"\r\n", b"\r\nx-big: " + b"a" * draw(st.integers(60_000, 120_000)) + b"\r\n", 1)
    return data, may_hang


def statuses_in(answer: bytes) -> list[int]:
    found = []
    for line in answer.split(b"\r\n"):
        if line.startswith(b"HTTP/1.") and len(line) >= 12 and line[9:12].isdigit():
            found.append(int(line[9:12]))
    return found


def exchange(port: int, data: bytes, may_hang: bool) -> bytes:
    """Send ``data`` and read everything that comes back until the server closes. Bytes that may
    leave the server waiting for more are followed by a half-close (the server sees the request end)
    rather than by a wait for its timeouts."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        answer = b""
        try:
            sock.sendall(data)
            if may_hang:
                sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:  # reset by the server, refusing what it read: what it sent is kept
            pass
    return answer


def test_raw_socket_mutations(target: httpx.Client) -> None:
    port = int(str(target.base_url).rstrip("/").rsplit(":", 1)[1])

    @fuzz_settings("raw")
    @given(raw_requests())
    def run(request: tuple[bytes, bool]) -> None:
        data, may_hang = request
        codes = statuses_in(exchange(port, data, may_hang))
        TRIED["raw"] += 1
        for code in codes:
            STATUSES[str(code)] += 1
        assert all(code < 500 for code in codes), (codes, data[:300])

    run()
