"""Property tests: never raises, idempotent, deterministic (also across processes and hash seeds)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from proxy.canonical.rules.volatile_date import DEFAULT_PATTERNS
from proxy.canonical.rules.whitespace import has_trailing_whitespace

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = [
    {},
    {"rules": {"volatile_date": {"mode": "move"}, "env_block": {"enabled": True}}},
    {"rules": {"whitespace": {"final_newline": "strip", "nfc": False}, "tool_order": {"mode": "sort"}}},
    {"rules": {"dedupe_tools": {"on_name_conflict": "keep_first"}, "whitespace": {"final_newline": "keep"}}},
]

# Fragments that exercise every text rule and its edges; joined with random separators.
FRAGMENTS = [
    "You are a coding agent.",
    "x-anthropic-billing-header: cc_version=2.1.30.4c1; cc_entrypoint=cli; cch=5d21e;",
    "x-anthropic-billing-header: cc_version=2.1.30.9ab; cch=1;",
    "The current date is 2025-08-28 14:03:27.",
    "  Today's date: Thu Jul 31 2025",
    "- Current date: 2025-11-03",
    "# Current Time\n11/3/2025, 9:14:07 AM (Europe/Berlin, UTC+1:00)",
    "<env>\nWorking directory: /srv\n</env>",
    "Environment:\n<env>\nPlatform: linux\n</env>\n<project>\n  a/\n</project>",
    "====\n\nSYSTEM INFORMATION\n\nOperating System: Linux\nDefault Shell: /bin/bash\n\n====",
    "```\ncode   \n2025-01-01 10:00:00\n```",
    "~~~\n<env>\nx\n</env>\n",
    "@@ -1 +1 @@\n-a \n+b \n ",
    "*** Begin Patch\n*** Update File: f\n \n-x\n*** End Patch",
    "--- a/f\n+++ b/f",
    "Cafe\u0301  ",
    "trailing\t \r",
    "",
    " ",
    "====",
]
SEPARATORS = ["\n", "\n\n", "\r\n", " ", ""]

text = st.lists(st.tuples(st.sampled_from(FRAGMENTS), st.sampled_from(SEPARATORS)), max_size=8).map(
    lambda pairs: "".join(f + s for f, s in pairs)
)
content = st.one_of(
    text,
    st.lists(
        st.one_of(text.map(lambda t: {"type": "text", "text": t}), st.just({"type": "image_url"})), max_size=3
    ),
)


@st.composite
def tools(draw: st.DrawFn) -> list[Any]:
    names = draw(st.lists(st.sampled_from(["a", "b", "c", "mcp__x__y"]), max_size=6))
    out = []
    for name in names:
        params = {
            "type": "object",
            "properties": {"p": {"type": "string", "description": "d"}},
            "required": ["p"],
        }
        if draw(st.booleans()):
            params = dict(reversed(list(params.items())))
        fn: dict[str, Any] = {
            "name": name,
            "description": draw(st.sampled_from(["x", "y"])),
            "parameters": params,
        }
        if draw(st.booleans()):
            fn = dict(reversed(list(fn.items())))
        out.append(
            {"type": "function", "function": fn}
            if draw(st.booleans())
            else {"function": fn, "type": "function"}
        )
    return out


message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "tool"]), "content": content}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.none()}),
)
request = st.fixed_dictionaries(
    {
        "messages": st.tuples(
            st.lists(
                st.fixed_dictionaries({"role": st.sampled_from(["system", "developer"]), "content": content}),
                max_size=3,
            ),
            st.lists(message, max_size=5),
        ).map(lambda pair: pair[0] + pair[1]),
        "tools": tools(),
    }
)
json_value = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "role",
                    "content",
                    "messages",
                    "tools",
                    "function",
                    "name",
                    "type",
                    "text",
                    "parameters",
                    "properties",
                ]
            ),
            children,
            max_size=4,
        )
    ),
    max_leaves=30,
)

# CANON_HYPOTHESIS_EXAMPLES raises the example count for a deeper local run.
FAST = settings(
    max_examples=int(os.environ.get("CANON_HYPOTHESIS_EXAMPLES", "150")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def dump(value: Any) -> bytes:
    return orjson.dumps(value)


@FAST
@given(request, st.sampled_from(range(len(CONFIGS))))
def test_idempotent_and_deterministic_on_generated_requests(body: dict[str, Any], config_index: int) -> None:
    config = CanonicalConfig.model_validate(CONFIGS[config_index])
    before = dump(body)
    canon = Canonicalizer(config, strict=True)
    state = InMemorySessionCanonState()
    once = canon.apply(body, api="chat", session=state).body
    assert dump(body) == before  # the input is never mutated
    assert dump(canon.apply(once, api="chat", session=state).body) == dump(once)
    # Without session state too, and a second canonicalizer (cold caches) gives the same bytes.
    stateless = Canonicalizer(config, strict=True).apply(body, api="chat").body
    assert dump(Canonicalizer(config, strict=True).apply(body, api="chat").body) == dump(stateless)
    assert dump(canon.apply(stateless, api="chat").body) == dump(stateless)


@FAST
@given(
    st.dictionaries(st.sampled_from(["messages", "tools", "model"]), json_value, max_size=3),
    st.sampled_from(range(len(CONFIGS))),
)
def test_never_raises_on_any_json_object(body: dict[str, Any], config_index: int) -> None:
    canon = Canonicalizer(CanonicalConfig.model_validate(CONFIGS[config_index]), strict=True)
    once = canon.apply(body, api="chat", session=InMemorySessionCanonState()).body
    assert canon.apply(once, api="chat").body == canon.apply(once, api="chat").body


_DIGEST_SCRIPT = """
import hashlib, json, sys
import orjson
from pathlib import Path
from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from proxy.canonical.rules.volatile_date import DEFAULT_PATTERNS
from proxy.canonical.rules.whitespace import has_trailing_whitespace
h = hashlib.sha256()
for config in json.loads(sys.argv[1]):
    canon = Canonicalizer(CanonicalConfig.model_validate(config), strict=True)
    for path in sorted(Path(sys.argv[2]).glob("*.json")):
        state = InMemorySessionCanonState()
        for turn in json.loads(path.read_text(encoding="utf-8"))["turns"]:
            h.update(orjson.dumps(canon.apply(turn, api="chat", session=state).body))
        h.update(orjson.dumps(canon.apply(turn, api="chat").body))
print(h.hexdigest())
"""


def test_same_bytes_across_processes_and_hash_seeds() -> None:
    data = ROOT / "tests" / "data" / "agents"
    digests = set()
    for seed in ("0", "1234567"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "LC_ALL": "C", "PYTHONPATH": str(ROOT)}
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT, json.dumps(CONFIGS), str(data)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        digests.add(out.stdout.strip())
    assert len(digests) == 1
    assert len(hashlib.sha256().hexdigest()) == len(digests.pop())


# The ISO date-time pattern in its plain form (the year a look-behind before the first "-"): the
# shipped one starts with the "-" so that re scans for it, and must match exactly where this does.
_ISO_PLAIN = (
    r"(?<=\d{4})-\d{2}-\d{2}(?P<time>[T ]\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d{1,9})?)?"
    r"(?:[ \u202f]?[AaPp]\.?[Mm]\.?)?(?:Z|[+-]\d{2}:?\d{2})?)(?![\d:])"
)


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet="0123456789-T :Z+.,apmAPM\u202fx", max_size=48))
def test_the_iso_datetime_pattern_matches_where_its_plain_form_does(text: str) -> None:
    shipped = re.compile(DEFAULT_PATTERNS["iso_datetime"][0])
    plain = re.compile(_ISO_PLAIN)
    found = [(m.span(), m.span("time")) for m in shipped.finditer(text)]
    assert found == [(m.span(), m.span("time")) for m in plain.finditer(text)]


@settings(max_examples=500, deadline=None)
@given(st.text(alphabet=" \t\nab\r", max_size=40))
def test_trailing_whitespace_is_found_where_the_plain_regex_finds_it(text: str) -> None:
    assert has_trailing_whitespace(text) == (re.search(r"[ \t]+(?:\n|\Z)", text) is not None)
