"""The simulated rank through HTTP: shapes, hit accounting, metrics, controls."""

from __future__ import annotations

import re

import httpx
import orjson
import pytest

from bench.sim import SimConfig, SimRankServer, start_fleet, stop_fleet
from tests.helpers.ranks import RankServers
from tokenization.tiktoken_tokenizer import encode, render

SYSTEM = "You are a careful coding agent. " * 40
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]


def chat(url: str, messages: list[dict], **extra: object) -> dict:
    r = httpx.post(
        f"{url}/v1/chat/completions", json={"model": "m", "messages": messages, **extra}, timeout=10
    )
    assert r.status_code == 200, r.text
    return r.json()


def sse(text: str) -> list[object]:
    events = re.findall(r"data: (.*?)\n\n", text, re.S)
    return [e if e == "[DONE]" else orjson.loads(e) for e in events]


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_tokenize_matches_template_and_hits_follow_turns(sim: SimRankServer) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "fix the bug"}]
    tok = httpx.post(f"{sim.url}/tokenize", json={"model": "m", "messages": messages, "tools": TOOLS}).json()
    expected = encode(render(messages, TOOLS))
    assert tok["tokens"] == expected and tok["count"] == len(expected)
    n = len(expected)

    first = chat(sim.url, messages, tools=TOOLS, tool_choice="auto")
    assert first["object"] == "chat.completion" and first["id"].startswith("chatcmpl-")
    assert first["usage"]["prompt_tokens"] == n
    assert first["usage"]["completion_tokens"] == 16
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert first["choices"][0]["finish_reason"] == "length"

    again = chat(sim.url, messages, tools=TOOLS)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * ((n - 1) // 16)

    reply = first["choices"][0]["message"]["content"]
    turn2 = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "now test it"}]
    second = chat(sim.url, turn2, tools=TOOLS)
    # The reply's blocks were cached as they were decoded: only the tail after them is recomputed.
    n2 = second["usage"]["prompt_tokens"]
    cached2 = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert (n + 15) // 16 * 16 <= cached2 <= 16 * ((n2 - 1) // 16)


def test_metrics_equal_sum_of_reported_cached_tokens(sim: SimRankServer) -> None:
    total_cached = 0
    total_prompt = 0
    base = [{"role": "system", "content": SYSTEM}]
    for i in range(4):
        messages = [*base, {"role": "user", "content": f"question {i % 2}"}]
        body = chat(sim.url, messages, max_tokens=3)
        total_cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
        total_prompt += body["usage"]["prompt_tokens"]
    r = httpx.post(
        f"{sim.url}/v1/completions",
        json={
            "model": "m",
            "prompt": render(base),
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=10,
    )
    usage = sse(r.text)[-2]["usage"]  # type: ignore[index]
    total_cached += usage["prompt_tokens_details"]["cached_tokens"]
    total_prompt += usage["prompt_tokens"]
    assert total_cached > 0
    assert metric(sim.url, "vllm:prefix_cache_hits_total") == total_cached
    assert metric(sim.url, "vllm:prefix_cache_queries_total") == total_prompt
    assert metric(sim.url, "vllm:num_requests_running") == 0
    assert metric(sim.url, "vllm:kv_cache_usage_perc") == 0
    text = httpx.get(f"{sim.url}/metrics").text
    assert 'block_size="16"' in text and 'num_gpu_blocks="512"' in text
    assert "vllm:num_preemptions_total" in text and "vllm:num_requests_waiting" in text


def test_stream_shape_and_n(sim: SimRankServer) -> None:
    messages = [{"role": "user", "content": "hello"}]
    r = httpx.post(
        f"{sim.url}/v1/chat/completions",
        json={"model": "m", "messages": messages, "stream": True, "max_tokens": 5, "n": 2},
        timeout=10,
    )
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in chunks)  # type: ignore[index]
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]  # type: ignore[index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert len(mine) == 6 and mine[-1]["finish_reason"] == "length"
        assert all(m["finish_reason"] is None for m in mine[:-1])
    body = chat(sim.url, messages, n=3, max_tokens=2)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["completion_tokens"] == 6


def test_completions_token_ids_and_errors(sim: SimRankServer) -> None:
    r = httpx.post(
        f"{sim.url}/v1/completions", json={"model": "m", "prompt": list(range(64)), "max_tokens": 2}
    )
    body = r.json()
    assert body["object"] == "text_completion" and body["usage"]["prompt_tokens"] == 64
    r = httpx.post(
        f"{sim.url}/v1/completions", json={"model": "m", "prompt": list(range(64)), "max_tokens": 2}
    )
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    too_long = httpx.post(f"{sim.url}/v1/completions", json={"prompt": "x", "max_tokens": 200_000})
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == 400
    assert httpx.post(f"{sim.url}/v1/chat/completions", content=b"{nope").status_code == 400
    assert httpx.post(f"{sim.url}/detokenize", json={"tokens": encode("hi there")}).json() == {
        "prompt": "hi there"
    }


def test_info_endpoints_and_reset(sim: SimRankServer) -> None:
    models = httpx.get(f"{sim.url}/v1/models").json()
    assert models["data"][0]["id"] == "prefixgate-sim" and models["data"][0]["max_model_len"] == 131_072
    assert httpx.get(f"{sim.url}/health").status_code == 200
    assert httpx.get(f"{sim.url}/server_info").json()["page_size"] == 16
    assert httpx.get(f"{sim.url}/model_info").json()["is_generation"] is True
    assert httpx.get(f"{sim.url}/kv_event_sources").json() == []
    prompt = {"model": "m", "prompt": list(range(64)), "max_tokens": 1}
    httpx.post(f"{sim.url}/v1/completions", json=prompt)
    assert httpx.post(f"{sim.url}/sim/reset").json() == {"reset": True}
    again = httpx.post(f"{sim.url}/v1/completions", json=prompt).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    state = httpx.get(f"{sim.url}/sim/state").json()
    assert state["num_blocks"] == 512 and state["counters"]["requests_finished"] == 2


def test_prompt_tokens_details_off_and_forced_usage(rank_servers: RankServers) -> None:
    (s,) = rank_servers.sim(1, num_blocks=64, enable_prompt_tokens_details=False, force_include_usage=True)
    r = httpx.post(f"{s.url}/v1/completions", json={"prompt": "hello", "stream": True}, timeout=10)
    usage = sse(r.text)[-2]["usage"]  # type: ignore[index]
    assert usage["prompt_tokens_details"] is None and usage["completion_tokens"] == 16


def test_fleet_names_and_ports() -> None:
    # bench.sim's own fleet starter (prefixgate demo, the benchmarks): the unit under test here
    fleet = start_fleet(2, SimConfig(num_blocks=64, time_scale=0))
    try:
        assert [s.name for s in fleet] == ["sim-0", "sim-1"]
        assert len({s.url for s in fleet}) == 2
        for s in fleet:
            assert httpx.get(f"{s.url}/health").status_code == 200
    finally:
        stop_fleet(fleet)


@pytest.mark.parametrize("api", ["chat", "messages"])
def test_a_streams_first_chunk_comes_after_its_prefill(rank_servers: RankServers, api: str) -> None:
    # ~1 s of modelled prefill: the first chunk used to go out at once, long before it
    (slow,) = rank_servers.sim(1, num_blocks=512, prefill_rate=2_000, time_scale=1.0)
    before = metric(slow.url, "vllm:prompt_tokens_total")
    body: dict[str, object] = {
        "model": "m",
        "messages": [{"role": "user", "content": SYSTEM * 8}],  # ~2,300 tokens
        "stream": True,
        "max_tokens": 3,
    }
    if api == "chat":
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if api == "chat" else "/v1/messages"
    with httpx.stream("POST", f"{slow.url}{path}", json=body, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        # the rank counts a prompt once its prefill is done (vllm:prompt_tokens): so it already has
        prefilled = metric(slow.url, "vllm:prompt_tokens_total") - before
        rest = "\n".join(lines)
    event = orjson.loads(first.removeprefix("data: "))
    if api == "chat":
        assert event["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        events = sse(f"{first}\n{rest}\n\n")
        assert events[-1] == "[DONE]" and len(events) == 1 + 3 + 2  # the role, 3 tokens, usage, [DONE]
        prompt_tokens = events[-2]["usage"]["prompt_tokens"]  # type: ignore[index]
    else:
        assert event["type"] == "message_start"
        assert rest.count("event: content_block_delta") == 3 and "event: message_stop" in rest
        prompt_tokens = event["message"]["usage"]["input_tokens"]
    assert prompt_tokens > 2_000 and prefilled == prompt_tokens
