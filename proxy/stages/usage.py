"""What a rank reported about a request: its usage (tokens, prefix-cache hits), read from the JSON
body of a plain response or from the tail of a stream (vLLM sends the usage chunk last, just before
``data: [DONE]``), so streamed chunks are never parsed one by one."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the rank did not say (no --enable-prompt-tokens-details)


def usage_from_dict(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached if isinstance(cached, int) else None)


def usage_of_json(data: Any) -> Usage | None:
    """Usage from a chat/completions response body or stream chunk, already parsed."""
    return usage_from_dict(data.get("usage")) if isinstance(data, dict) else None


def json_or_none(body: bytes) -> Any:
    """A plain response's parsed JSON body; None when it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


def last_event_with(chunks: Iterable[bytes], needle: bytes, read: Callable[[Any], Any]) -> Any:
    """``read(event)`` of the last ``data:`` event containing ``needle`` that ``read`` accepts (not
    None), among a stream's last raw chunks; None when there is none."""
    tail = b"".join(chunks)
    end = len(tail)
    while True:
        start = tail.rfind(b"data:", 0, end)
        if start < 0:
            return None
        line_end = tail.find(b"\n", start)
        payload = tail[start + 5 : line_end if line_end >= 0 else len(tail)].strip()
        if payload.startswith(b"{") and needle in payload:
            try:
                found = read(orjson.loads(payload))
            except orjson.JSONDecodeError:
                found = None
            if found is not None:
                return found
        end = start
