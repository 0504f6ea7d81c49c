"""A client whose base URL misses (or doubles) ``/v1`` gets a 404 that says which path it meant and
what to set base_url to (issue 49: a bare 404), and never an answer from another path."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

CHAT = {"model": "model-0", "messages": [{"role": "user", "content": "hi"}]}


def test_the_openai_sdk_without_v1_is_told_to_add_it(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(**CHAT)
    message = raised.value.body["message"]
    assert "no such endpoint: POST /chat/completions; did you mean /v1/chat/completions?" in message
    assert f"set base_url to {server.url}/v1" in message
    assert rank.behavior.received == []  # not silently served as /v1/chat/completions


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/completions"),
        ("POST", "/responses"),
        ("POST", "/messages"),
        ("GET", "/models"),
        ("GET", "/responses/resp_1"),
    ],
)
def test_every_api_path_without_v1_gets_the_hint(rank_servers, proxy, method, path):
    server = proxy(rank_servers.stub(1))
    response = httpx.request(method, server.url + path, json={})
    assert response.status_code == 404
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "http_404"
    assert f"did you mean /v1{path}?" in error["message"]


def test_anthropics_sdk_with_v1_in_its_base_url_is_told_to_drop_it(rank_servers, proxy):
    server = proxy(rank_servers.stub(1))
    client = anthropic.Anthropic(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="model-0", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    message = str(raised.value)
    assert "did you mean /v1/messages?" in message and f"set base_url to {server.url} " in message


def test_an_unknown_path_gets_no_hint(rank_servers, proxy):
    server = proxy(rank_servers.stub(1))
    for path in ("/nothing", "/v1/nothing", "/v1/v1/nothing"):
        response = httpx.post(server.url + path, json={})
        assert response.status_code == 404
        assert response.json()["error"]["message"] == f"no such endpoint: POST {path}"
