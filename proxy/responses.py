"""OpenAI's Responses API (Codex CLI): ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

Canonicalization sees ``instructions`` as the leading system message, the ``input`` items as
messages (a string input as one user message) and the function tools in chat form; the rewrites go
back into ``instructions``, ``input`` (text parts added to a message become ``input_text``) and
``tools`` (non-function tools kept after the function ones). Hits come from
``usage.input_tokens_details.cached_tokens``.

A rank stores the responses it generated. A request continuing one (``previous_response_id``) and a
retrieval must reach that rank: ``ResponseRanks`` maps response ids to rank names, in memory
(bounded) or in Redis when ``redis_url`` is set, so that every prefixgate replica finds them.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

from starlette.responses import Response

from proxy.agent_api import (
    canon_view_of,
    check_stream_and_model,
    int_or_none,
    tool_from_chat,
    unslot_messages,
    usage_of,
)
from proxy.context import ApiKind
from proxy.errors import ProxyError, bad_request, error_response, sse_error_event
from proxy.limits import Bounds, check_bounds, too_many
from proxy.observe import Usage
from tokenization.agent_apis import responses_to_chat, responses_tools_to_chat
from tokenization.lru import LRU

log = logging.getLogger("prefixgate.responses")

#: Response ids remembered per process when there is no Redis.
DEFAULT_CAPACITY = 200_000
#: How long Redis keeps a response id's rank (vLLM's in-memory store has no expiry; a week bounds it).
REDIS_TTL_S = 7 * 24 * 3600
REDIS_PREFIX = "prefixgate:response:"
_TEXT_ROLES = frozenset({"user", "system", "developer"})


class ResponsesApi:
    kind = ApiKind.RESPONSES

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        check_stream_and_model(body)
        items = body.get("input")
        if not isinstance(items, (str, list)):
            raise bad_request("'input' must be a string or a list of items", param="input")
        if isinstance(items, list) and len(items) > bounds.max_messages:
            raise too_many(
                "input items", len(items), bounds.max_messages, "max_messages", "input", "too_many_messages"
            )
        previous = body.get("previous_response_id")
        if previous is not None and not (isinstance(previous, str) and previous):
            raise bad_request("'previous_response_id' must be a string", param="previous_response_id")
        check_bounds(body, ApiKind.RESPONSES, bounds)

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any]:
        instructions = body.get("instructions")
        items = body["input"]
        return canon_view_of(
            "instructions",
            instructions if isinstance(instructions, str) else None,
            [{"role": "user", "content": items}] if isinstance(items, str) else items,
            responses_tools_to_chat(body),
        )

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        out = dict(body)
        if after.get("messages") is not before.get("messages"):
            out["input"] = [_input_item(m) for m in unslot_messages(out, "instructions", after["messages"])]
        if after.get("tools") is not before.get("tools"):
            originals = body.get("tools") or []
            by_name = {
                t.get("name"): t for t in originals if isinstance(t, dict) and t.get("type") == "function"
            }
            function = {"type": "function"}
            tools: list[Any] = [
                tool_from_chat(tool, by_name.get(tool["function"]["name"], function), "parameters")
                for tool in after.get("tools") or ()
            ]
            tools.extend(t for t in originals if not (isinstance(t, dict) and t.get("type") == "function"))
            out["tools"] = tools
        return out

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        return responses_to_chat(body)

    def usage_from_json(self, data: Any) -> Usage | None:
        usage = usage_of(data, "response")  # nested in response.completed
        if usage is None:
            return None
        prompt = int_or_none(usage.get("input_tokens"))
        output = int_or_none(usage.get("output_tokens"))
        if prompt is None or output is None:
            return None
        details = usage.get("input_tokens_details")
        cached = int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Usage(prompt, output, cached)

    def error_response(self, exc: ProxyError, backend: str) -> Response:
        return error_response(exc, backend)

    def sse_error(self, message: str) -> bytes:
        return sse_error_event(message)


def _input_item(message: Any) -> Any:
    """A view message as a Responses input item: text parts the rules added become ``input_text``."""
    if not isinstance(message, dict) or message.get("role") not in _TEXT_ROLES:
        return message
    content = message.get("content")
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return message
    parts = [
        {**p, "type": "input_text"} if isinstance(p, dict) and p.get("type") == "text" else p for p in content
    ]
    return {**message, "content": parts}


# -- response id -> rank ------------------------------------------------------------------------------
class ResponseRanks(Protocol):
    def get(self, response_id: str) -> str | None:
        """The rank that stored ``response_id``, or None when unknown."""
        ...

    def put(self, response_id: str, backend: str) -> None: ...


class MemoryResponseRanks(LRU[str, str]):
    """Response id -> rank name, least recently used ids dropped past ``capacity``."""

    __slots__ = ()

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        super().__init__(capacity)


class RedisResponseRanks:
    """Response id -> rank name in Redis (shared by replicas), with a local copy for when it is down."""

    def __init__(self, client: Any, ttl: int = REDIS_TTL_S, local: MemoryResponseRanks | None = None) -> None:
        self.client = client
        self.ttl = ttl
        self.local = local or MemoryResponseRanks()

    @classmethod
    def from_url(cls, url: str, timeout: float) -> RedisResponseRanks:
        import redis

        return cls(redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout))

    def get(self, response_id: str) -> str | None:
        backend = self.local.get(response_id)
        if backend is not None:
            return backend
        try:
            value = self.client.get(REDIS_PREFIX + response_id)
        except Exception as exc:  # a Redis outage must not fail requests: answer from the local copy
            log.warning("redis lookup of a response id failed: %s", exc)
            return None
        if value is None:
            return None
        backend = value.decode() if isinstance(value, bytes) else str(value)
        self.local.put(response_id, backend)
        return backend

    def put(self, response_id: str, backend: str) -> None:
        self.local.put(response_id, backend)
        try:
            self.client.set(REDIS_PREFIX + response_id, backend, ex=self.ttl)
        except Exception as exc:
            log.warning("redis store of a response id failed: %s", exc)


def make_response_ranks(redis_url: str | None, timeout: float) -> ResponseRanks:
    if redis_url:
        return RedisResponseRanks.from_url(redis_url, timeout)
    return MemoryResponseRanks()
