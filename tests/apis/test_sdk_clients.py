"""The official SDKs against prefixgate in front of simulated ranks: Anthropic Messages, OpenAI Responses."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

SYSTEM_TEXT = "You are Claude Code, an interactive CLI tool for software engineering tasks. " * 30
TOOLS = [
    {
        "name": "Read",
        "description": "Read a file from the local filesystem.",
        "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
    },
    {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
        "cache_control": {"type": "ephemeral"},
    },
]


def system_blocks(cch: str) -> list[dict]:
    return [
        {
            "type": "text",
            "text": f"x-anthropic-billing-header: cc_version=2.1.37.a1f; cc_entrypoint=cli; cch={cch};",
        },
        {"type": "text", "text": SYSTEM_TEXT, "cache_control": {"type": "ephemeral"}},
    ]


def anthropic_client(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="test", max_retries=0, timeout=30)


def openai_client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=30)


def test_messages_create_and_stream_with_tools_and_system_blocks(rank_servers, gateway):
    proxy = gateway(rank_servers.sim(2))
    client = anthropic_client(proxy.url)
    session = {"x-claude-code-session-id": "cc-sdk-1"}
    first_user = {"role": "user", "content": [{"type": "text", "text": "Fix the failing test. " * 40}]}
    raw = client.messages.with_raw_response.create(
        model="sim",
        max_tokens=16,
        system=system_blocks("aaaaa"),
        tools=TOOLS,
        messages=[first_user],
        extra_headers=session,
    )
    first = raw.parse()
    assert raw.headers["x-prefixgate-session"] == "cc-sdk-1"
    assert first.type == "message" and first.role == "assistant"
    assert first.content[0].type == "text" and first.content[0].text
    assert first.stop_reason == "max_tokens" and first.usage.output_tokens == 16
    assert first.usage.cache_read_input_tokens == 0
    backend = raw.headers["x-prefixgate-backend"]

    # turn 2, streamed: a different billing hash, the history repeated, a tool round trip
    messages = [
        first_user,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {"file_path": "a.py"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "print('hi')"}]},
    ]
    with client.messages.stream(
        model="sim",
        max_tokens=8,
        system=system_blocks("bbbbb"),
        tools=TOOLS,
        messages=messages,
        extra_headers=session,
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
        headers = stream.response.headers
    assert text and final.content[0].text == text
    assert final.stop_reason == "max_tokens"
    assert headers["x-prefixgate-backend"] == backend  # the session stays where its blocks are
    prompt = final.usage.input_tokens + final.usage.cache_read_input_tokens
    assert final.usage.cache_read_input_tokens >= prompt - 100  # everything up to the new turn hit
    assert int(headers["x-prefixgate-estimated-cached-tokens"]) == final.usage.cache_read_input_tokens

    count = client.messages.count_tokens(
        model="sim", system=system_blocks("c"), tools=TOOLS, messages=messages
    )
    assert count.input_tokens == prompt


def test_messages_errors_have_anthropic_shape(rank_servers, gateway):
    proxy = gateway(rank_servers.sim(1))
    client = anthropic_client(proxy.url)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="sim", max_tokens=4, messages="not a list")  # type: ignore[arg-type]
    assert caught.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "'messages' must be a list of messages"},
    }
    # an error from the rank is relayed in its (Anthropic) shape too
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="sim", max_tokens=0, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_messages_stream_broken_mid_way_ends_with_an_anthropic_error_event(rank_servers, gateway):
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, retries=0)
    ranks[0].set_faults(die_after_chunks=4)
    client = anthropic_client(proxy.url)
    stream = client.messages.stream(
        model="sim", max_tokens=32, messages=[{"role": "user", "content": "hello"}]
    )
    with pytest.raises(anthropic.APIStatusError) as caught, stream as events:  # raised on `event: error`
        for _ in events:
            pass
    assert "broke mid-stream" in str(caught.value)


def test_responses_create_stream_previous_response_and_retrieve(rank_servers, gateway):
    ranks = rank_servers.sim(3)
    proxy = gateway(ranks)
    client = openai_client(proxy.url)
    tools = [
        {
            "type": "function",
            "name": "shell",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "array"}}},
            "strict": False,
        }
    ]
    instructions = "You are Codex, a coding agent running in a terminal. " * 30
    first = client.responses.with_raw_response.create(
        model="sim",
        instructions=instructions,
        input=[
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "List the files."}],
            }
        ],
        tools=tools,
        max_output_tokens=8,
        extra_headers={"session-id": "codex-1"},
    )
    r1 = first.parse()
    owner = first.headers["x-prefixgate-backend"]
    assert r1.id.startswith("resp_") and r1.status == "completed" and r1.output_text
    assert r1.usage.input_tokens_details.cached_tokens == 0

    # continuing with previous_response_id must reach the rank that stored r1, streamed
    others = {r.name: r.rank.counters.prompt_tokens for r in ranks if r.name != owner}
    for _ in range(3):
        with client.responses.stream(
            model="sim",
            instructions=instructions,
            previous_response_id=r1.id,
            input="Now run the tests.",
            tools=tools,
            max_output_tokens=8,
        ) as stream:
            deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
            r2 = stream.get_final_response()
        assert "".join(deltas) == r2.output_text
        # the stored conversation is r1's prompt and answer: all of it is cached on the owner
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens - 16

    assert {r.name: r.rank.counters.prompt_tokens for r in ranks if r.name != owner} == others
    fetched = client.responses.with_raw_response.retrieve(r2.id)
    assert fetched.headers["x-prefixgate-backend"] == owner
    assert fetched.parse().id == r2.id and fetched.parse().output_text == r2.output_text


def test_responses_rank_gone_is_a_clear_error_never_another_rank(rank_servers, gateway):
    ranks = rank_servers.sim(2)
    proxy = gateway(ranks, retries=2)
    client = openai_client(proxy.url)
    r1 = client.responses.with_raw_response.create(model="sim", input="hello " * 50, max_output_tokens=4)
    owner = next(r for r in ranks if r.name == r1.headers["x-prefixgate-backend"])
    other = next(r for r in ranks if r is not owner)
    before = other.rank.counters.prompt_tokens
    owner.stop()
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(
            model="sim", previous_response_id=r1.parse().id, input="go on", max_output_tokens=4
        )
    assert caught.value.status_code in (502, 503)
    assert owner.name in str(caught.value)
    with pytest.raises(openai.APIStatusError):
        client.responses.retrieve(r1.parse().id)
    assert other.rank.counters.prompt_tokens == before  # nothing was sent to the wrong rank

    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(
            model="sim", previous_response_id="resp_unknown", input="x", max_output_tokens=4
        )
    assert missing.value.body["code"] == "response_not_found"


def test_unknown_response_ids_are_found_by_asking_the_ranks(rank_servers, gateway):
    """A response stored before this prefixgate process started (no Redis) is still found."""
    ranks = rank_servers.sim(3)
    created = httpx.post(
        ranks[2].url + "/v1/responses", json={"model": "sim", "input": "hi", "max_output_tokens": 2}
    )
    response_id = created.json()["id"]
    proxy = gateway(ranks)
    fetched = httpx.get(f"{proxy.url}/v1/responses/{response_id}", timeout=10)
    assert fetched.status_code == 200 and fetched.headers["x-prefixgate-backend"] == ranks[2].name
