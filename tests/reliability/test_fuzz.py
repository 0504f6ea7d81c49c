"""Property-based fuzzing of prefixgate's HTTP surface (hypothesis) against a real server.

Malformed JSON, invalid UTF-8, wrong types in every field, unknown roles, tools with invalid
schemas, odd streaming flags, huge and deeply nested bodies, odd headers. The proxy must answer
every one with a 4xx and an OpenAI error body, or pass it to the rank; never a 500, never a crash,
and it keeps serving afterwards. The number of inputs tried is printed and written to
``bench/out/fuzz.json``.
"""

from __future__ import annotations

import string
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import fuzz_values
from tests.reliability.conftest import SIM_MODEL, chat

OUT = Path(__file__).resolve().parents[2] / "bench" / "out" / "fuzz.json"
EXAMPLES = 100
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
TRIED: Counter[str] = Counter()
STATUSES: Counter[str] = Counter()

json_values = fuzz_values.json_values(text_size=20, items=4, leaves=20)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "function"]) | st.text(
    max_size=10
)
content = (
    st.text(max_size=60)
    | json_values
    | st.lists(
        st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]), "text": json_values}),
        max_size=3,
    )
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": roles, "content": content},
        optional={"name": json_values, "tool_calls": json_values, "tool_call_id": json_values},
    )
    | json_values,
    max_size=6,
)
tools = st.lists(
    st.fixed_dictionaries(
        {
            "type": st.sampled_from(["function", "bogus"]) | json_values,
            "function": st.fixed_dictionaries(
                {"name": st.text(max_size=12) | json_values},
                optional={"description": json_values, "parameters": json_values, "strict": json_values},
            )
            | json_values,
        }
    )
    | json_values,
    max_size=4,
)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(SIM_MODEL) | json_values,
    "messages": messages | json_values,
    "tools": tools,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}) | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=64) | json_values,
    "temperature": json_values,
    "n": st.integers(min_value=1, max_value=2),
    "cache_salt": json_values,
    "prompt_cache_key": json_values,
    "user": json_values,
    "response_format": json_values,
}
chat_bodies = st.fixed_dictionaries(
    {"model": FIELDS["model"]}, optional={k: v for k, v in FIELDS.items() if k != "model"}
)
header_values = st.text(alphabet=string.printable.strip() + " ", max_size=40)
headers = st.dictionaries(
    st.sampled_from(
        ["x-session-id", "x-prefixgate-session", "authorization", "user-agent", "x-client-request-id"]
    ),
    header_values.map(str.strip),
    max_size=3,
)


@pytest.fixture(scope="module")
def fuzz_target():
    """One stub rank and one prefixgate for the whole module (hypothesis runs many examples)."""
    from tests.helpers.gateway import start_gateway
    from tests.helpers.ranks import RankServers

    with RankServers(stub_model=SIM_MODEL) as ranks:  # module scope: not the per-test fixture
        proxy = start_gateway(
            ranks.stub(1, record=False, chunks=2),
            retries=0,
            max_body_bytes=256 * 1024,
            max_json_depth=32,
            health_interval=5.0,
        )
        client = httpx.Client(base_url=proxy.url, timeout=15)
        yield client
        client.close()
        proxy.stop()
    write_report()


def write_report() -> None:
    fuzz_values.write_counts(OUT, "fuzz", TRIED, STATUSES)


def check(response: httpx.Response, kind: str) -> None:
    """No 500, no crash; every error is an OpenAI error body. 502 only when the (stub) rank failed."""
    TRIED[kind] += 1
    STATUSES[str(response.status_code)] += 1
    status = response.status_code
    if status == 200:
        return
    assert status < 500 or status == 502, (status, response.text)
    error = orjson.loads(response.content)["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    if status == 502:
        assert error["code"] == "upstream_failed"


def test_raw_bytes_and_broken_json(fuzz_target):
    @FUZZ_SETTINGS
    @given(
        st.binary(max_size=300)
        | st.text(max_size=200).map(str.encode)
        | chat_bodies.map(orjson.dumps).flatmap(
            lambda raw: st.integers(0, len(raw)).map(lambda cut: raw[:cut] + b"\xff\xfe" + raw[cut:])
        ),
        st.sampled_from(["/v1/chat/completions", "/v1/completions", "/tokenize"]),
    )
    def run(body: bytes, path: str) -> None:
        check(fuzz_target.post(path, content=body, headers={"content-type": "application/json"}), "raw")

    run()


def test_wrong_types_in_every_field(fuzz_target):
    @FUZZ_SETTINGS
    @given(chat_bodies, headers)
    def run(body: dict[str, Any], extra_headers: dict[str, str]) -> None:
        check(fuzz_target.post("/v1/chat/completions", json=body, headers=extra_headers), "chat")

    run()


def test_completions_prompts_of_any_shape(fuzz_target):
    @FUZZ_SETTINGS
    @given(
        st.fixed_dictionaries(
            {"model": FIELDS["model"], "prompt": json_values},
            optional={k: FIELDS[k] for k in ("stream", "stream_options", "max_tokens", "n", "cache_salt")},
        )
    )
    def run(body: dict[str, Any]) -> None:
        check(fuzz_target.post("/v1/completions", json=body), "completions")

    run()


def test_huge_and_deep_bodies(fuzz_target):
    @settings(max_examples=60, deadline=None, database=None)
    @given(st.integers(1, 3000), st.integers(0, 400_000), st.sampled_from(["[", '{"a":']))
    def run(depth: int, size: int, opener: str) -> None:
        closer = "]" if opener == "[" else "}"
        deep = opener * depth + "1" + closer * depth
        body = f'{{"model":"m","messages":[{{"role":"user","content":"{"x" * size}"}}],"meta":{deep}}}'
        check(fuzz_target.post("/v1/chat/completions", content=body), "huge_or_deep")

    run()


def test_the_proxy_still_serves_after_the_fuzzing(fuzz_target):
    for stream in (False, True):
        response = fuzz_target.post("/v1/chat/completions", json=chat("still there?", stream=stream))
        assert response.status_code == 200
    assert fuzz_target.get("/health").json()["status"] == "ok"
