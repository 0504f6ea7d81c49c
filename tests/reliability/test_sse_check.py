"""The SSE stream checker: any split of a good stream passes, any split of a bad one is caught."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.stages.forward import SseChecker


def event(i: int) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "choices": [{"delta": {"content": f"tok {i}\n"}}]}) + b"\n\n"


GOOD = b"".join(event(i) for i in range(5)) + b": keep-alive comment\n\n" + b"data: [DONE]\n\n"
BAD = event(0) + b'data: {"id": "x", "choices": [{"delta": {"content": \n\n' + event(1)


def feed_split(stream: bytes, cuts: list[int]) -> str | None:
    checker = SseChecker()
    points = sorted({c % (len(stream) + 1) for c in cuts})
    for start, end in zip([0, *points], [*points, len(stream)], strict=True):
        problem = checker.feed(stream[start:end])
        if problem is not None:
            return problem
    return None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=12), st.booleans())
def test_chunking_never_changes_the_verdict(cuts, crlf):
    good, bad = (GOOD, BAD) if not crlf else (GOOD.replace(b"\n", b"\r\n"), BAD.replace(b"\n", b"\r\n"))
    assert feed_split(good, cuts) is None
    problem = feed_split(bad, cuts)
    assert problem is not None and problem.startswith("malformed SSE event")


def test_multi_line_data_is_joined_before_decoding():
    checker = SseChecker()
    assert checker.feed(b'data: {"a":\ndata: 1}\n\n') is None
    assert checker.feed(b"data: {\n\n") is not None


def test_one_whole_event_per_chunk_is_checked_as_any_other():
    checker = SseChecker()
    for i in range(3):
        assert checker.feed(event(i)) is None  # a token's usual chunk
    assert checker.feed(b'data: {"id": "x", "choices": [\n\n') is not None  # truncated JSON
    assert SseChecker().feed(b'data: {"id": "x"} trailing\n\n') is not None
    assert SseChecker().feed(b'data: {"id": "x"}\n\ndata: {"id"\n\n') is not None  # two events, one bad


def test_invalid_utf8_in_an_event_is_malformed():
    problem = SseChecker().feed(b'data: {"content": "\xff\xfe"}\n\n')
    assert problem is not None and problem.startswith("malformed SSE event")
