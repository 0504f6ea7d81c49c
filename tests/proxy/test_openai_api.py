"""The proxy as a client meets it: the official openai SDK against prefixgate against stub ranks."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
]


def client_for(server, api_key: str = "sk-test") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=20)


def test_chat_non_streaming_relays_the_rank_answer(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    raw = client_for(server).chat.completions.with_raw_response.create(model="model-0", messages=MESSAGES)
    completion = raw.parse()
    assert raw.headers["x-prefixgate-backend"] == rank.name
    assert completion.choices[0].message.content == "word word word"
    assert completion.usage.prompt_tokens_details.cached_tokens == completion.usage.prompt_tokens // 2
    assert rank.behavior.received[0]["body"]["messages"] == MESSAGES


def test_request_bytes_and_authorization_reach_the_rank_unchanged(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    body = (
        b'{"model":"model-0",  "messages":[{"role":"user","content":"x"}],"tools":'
        + httpx.Request("POST", "http://x", json=TOOLS).content
        + b"}"
    )
    response = httpx.post(
        server.url + "/v1/chat/completions",
        content=body,
        headers={"authorization": "Bearer sk-client-123", "content-type": "application/json"},
    )
    assert response.status_code == 200
    received = rank.behavior.received[0]
    assert received["headers"]["authorization"] == "Bearer sk-client-123"
    assert received["body"]["tools"] == TOOLS


def test_the_rank_sees_the_clients_user_agent_else_prefixgates(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    body = {"model": "model-0", "messages": MESSAGES}
    for agent in ("claude-cli/2.1 (external, cli)", None):
        headers = {"user-agent": agent} if agent else {}
        with httpx.Client() as client:
            client.headers.pop("user-agent")  # httpx's own, which would otherwise go along
            response = client.post(server.url + "/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200
    sent = [r["headers"].get("user-agent") for r in rank.behavior.received]
    assert sent == ["claude-cli/2.1 (external, cli)", "prefixgate"]


def test_tools_in_the_request(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    completion = client_for(server).chat.completions.create(
        model="model-0", messages=MESSAGES, tools=TOOLS, tool_choice="auto"
    )
    assert completion.choices[0].finish_reason == "stop"
    assert rank.behavior.received[0]["body"]["tools"] == TOOLS
    assert rank.behavior.received[0]["body"]["tool_choice"] == "auto"


def test_n_greater_than_one(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    completion = client_for(server).chat.completions.create(model="model-0", messages=MESSAGES, n=3)
    assert [c.index for c in completion.choices] == [0, 1, 2]


def test_stream_is_relayed_chunk_by_chunk(rank_servers, proxy):
    gate = threading.Event()
    (rank,) = rank_servers.stub(1, chunks=5, gate=gate)
    server = proxy([rank])
    stream = client_for(server).chat.completions.create(
        model="model-0", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
    )
    chunks = iter(stream)
    first = next(chunks)
    # The rank is held at its gate after the first chunk: the client saw it before the last was sent.
    assert first.choices[0].delta.content == "word0 "
    assert rank.behavior.chunks_sent == 1
    gate.set()
    rest = list(chunks)
    contents = [c.choices[0].delta.content for c in rest if c.choices]
    assert contents == ["word1 ", "word2 ", "word3 ", "word4 "]
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 5


def test_stream_response_headers(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        json={"model": "model-0", "messages": MESSAGES, "stream": True, "user": "alice"},
    ) as response:
        body = response.read()
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-prefixgate-backend"] == rank.name
    assert response.headers["x-prefixgate-session"] == "alice"
    assert body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("stream", [False, True])
def test_completions_endpoint(rank_servers, proxy, stream):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    client = client_for(server)
    if stream:
        texts = [
            c.choices[0].text for c in client.completions.create(model="model-0", prompt="abc", stream=True)
        ]
        assert texts == ["word0 ", "word1 ", "word2 "]
    else:
        completion = client.completions.create(model="model-0", prompt="abc", max_tokens=3)
        assert completion.choices[0].text == "word word word"
    assert rank.behavior.received[0]["path"] == "/v1/completions"


def test_models_is_the_union_of_the_ranks(rank_servers, proxy):
    ranks = rank_servers.stub(2)
    server = proxy(ranks)
    models = sorted(m.id for m in client_for(server).models.list())
    assert models == ["model-0", "model-1"]


def test_tokenize_and_detokenize_are_forwarded(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    tokens = httpx.post(server.url + "/tokenize", json={"model": "model-0", "prompt": "hi"}).json()
    assert tokens["tokens"] == [ord("h"), ord("i")]
    text = httpx.post(server.url + "/detokenize", json={"model": "model-0", "tokens": tokens["tokens"]})
    assert text.json() == {"prompt": "hi"}
    assert text.headers["x-prefixgate-backend"] == rank.name


def test_health_and_metrics(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    client_for(server).chat.completions.create(model="model-0", messages=MESSAGES)
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok"
    assert health["backends"][0]["name"] == rank.name and health["backends"][0]["healthy"] is True
    metrics = httpx.get(server.url + "/metrics").text
    assert (
        'prefixgate_requests_total{backend="stub-0",endpoint="/v1/chat/completions",status="200"} 1.0'
        in metrics
    )
    assert 'prefixgate_backend_up{backend="stub-0"} 1.0' in metrics
    assert "prefixgate_request_duration_seconds_bucket" in metrics
