"""The simulated rank's scripted-tool mode: calls to the request's shell tool, then a final text, in
each API's shapes, generated as the template renders them (so the answer's blocks are cached)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx

from bench.sim.scripted import script_for, shell_arguments
from tests.helpers.ranks import RankServers

BASH = {
    "type": "object",
    "properties": {
        "command": {"type": "string"},
        "timeout": {"type": "number"},
        "description": {"type": "string"},
    },
    "required": ["command"],
}


def fn(name: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": parameters}}


def test_arguments_from_the_tools_schema() -> None:
    assert shell_arguments(fn("Bash", BASH)["function"], 1) == {"command": "echo prefixgate-step-1 && ls"}
    codex = {"type": "object", "properties": {"cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}}}
    assert shell_arguments(fn("exec_command", codex)["function"], 2) == {
        "cmd": "echo prefixgate-step-2 && ls"
    }
    argv = {
        "type": "object",
        "properties": {
            "command": {"type": "array", "items": {"type": "string"}},
            "workdir": {"type": "string"},
        },
        "required": ["command", "workdir"],
    }
    assert shell_arguments(fn("shell", argv)["function"], 3) == {
        "command": ["bash", "-lc", "echo prefixgate-step-3 && ls"],
        "workdir": "step 3",
    }


def test_k_calls_per_user_turn_then_a_final_text() -> None:
    tools = [fn("read", {"type": "object"}), fn("bash", BASH)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": "s"}, {"role": "user", "content": "go"}]
    kinds = []
    for _ in range(5):
        script = script_for({"messages": messages, "tools": tools}, 2)
        assert script is not None
        kinds.append(script.call.name if script.call else "text")
        if script.call is None:
            messages += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "again"}]
            continue
        call = {
            "id": script.call.id,
            "type": "function",
            "function": {"name": "bash", "arguments": script.call.arguments},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "ok"},
        ]
    assert kinds == ["bash", "bash", "text", "bash", "bash"]
    assert (
        script_for({"messages": messages}, 2) is not None
        and script_for({"messages": messages}, 2).call is None
    )
    assert script_for({"messages": messages, "tools": tools}, 0) is None  # off


def test_each_api_answers_with_the_call_and_caches_it(rank_servers: RankServers, tmp_path: Path) -> None:
    record = tmp_path / "requests.jsonl"
    (rank,) = rank_servers.sim(1, scripted_tool_calls=1, record_path=str(record))
    system = "You are a coding agent. " * 40
    with httpx.Client(base_url=rank.url, timeout=30) as client:
        # chat completions, whole then streamed
        chat = {
            "model": "m",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}],
        }
        chat["tools"] = [fn("bash", BASH)]
        answer = client.post("/v1/chat/completions", json=chat).json()
        (call,) = answer["choices"][0]["message"]["tool_calls"]
        assert answer["choices"][0]["finish_reason"] == "tool_calls" and call["function"]["name"] == "bash"
        assert json.loads(call["function"]["arguments"]) == {"command": "echo prefixgate-step-1 && ls"}
        prompt, completion = answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]
        chat["messages"] += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "notes.txt"},
        ]
        body = client.post(
            "/v1/chat/completions", json={**chat, "stream": True, "stream_options": {"include_usage": True}}
        )
        events = [json.loads(line[6:]) for line in body.text.splitlines() if line.startswith("data: {")]
        assert "tool_calls" not in json.dumps(events)  # the turn's one call is made: a final text
        cached = events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt + completion - 1) // 16 * 16  # the answer's blocks were cached too

        # Anthropic Messages, streamed
        messages = {"model": "m", "max_tokens": 64, "system": system, "stream": True}
        messages["messages"] = [{"role": "user", "content": "go"}]
        messages["tools"] = [{"name": "Bash", "description": "b", "input_schema": BASH}]
        text = client.post("/v1/messages", json=messages).text
        assert (
            '"type": "tool_use"' in text
            and '"stop_reason": "tool_use"' in text
            and "input_json_delta" in text
        )

        # Responses, whole
        responses = {"model": "m", "instructions": system, "input": "go", "store": False}
        responses["tools"] = [
            {
                "type": "function",
                "name": "exec_command",
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            }
        ]
        item = client.post("/v1/responses", json=responses).json()["output"][0]
        assert item["type"] == "function_call" and json.loads(item["arguments"]) == {
            "cmd": "echo prefixgate-step-1 && ls"
        }
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["path"] for r in lines] == ["/v1/chat/completions"] * 2 + ["/v1/messages", "/v1/responses"]
    assert lines[2]["body"]["tools"][0]["name"] == "Bash" and "host" in lines[0]["headers"]
