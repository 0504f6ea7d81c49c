"""Request bounds: header size, message and tool counts, nesting depth.

The body size is bounded while it is read (``proxy.stages.parse.read_body``) and orjson refuses nesting past
1,024 levels; these bounds are tighter and name the limit that was hit, so a client sees which
setting to raise. The depth walk only visits containers (strings are the bulk of a prompt and are
skipped), and it stops at the first container past the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.config import Settings
from proxy.errors import ProxyError, error_response


@dataclass(frozen=True, slots=True)
class Bounds:
    """The per-request bounds checked at parse time (``Settings``' ``max_*`` fields)."""

    max_messages: int = 10_000
    max_tools: int = 1_000
    max_json_depth: int = 64

    @classmethod
    def from_settings(cls, settings: Settings) -> Bounds:
        return cls(settings.max_messages, settings.max_tools, settings.max_json_depth)


DEFAULT_BOUNDS = Bounds()


def headers_too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"request headers exceed the limit of {limit} bytes (max_header_bytes)",
        code="headers_too_large",
    )


def header_bytes(headers: list[tuple[bytes, bytes]]) -> int:
    """Size of the headers as sent: ``name: value\\r\\n`` per header (summed in C: it runs per request)."""
    return sum(map(len, chain.from_iterable(headers))) + 4 * len(headers)


class HeaderLimitMiddleware:
    """Answers 413 to any HTTP request whose headers total more than ``limit`` bytes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and header_bytes(scope["headers"]) > self.limit:
            await error_response(headers_too_large(self.limit))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """True when ``value`` nests arrays/objects more than ``limit`` levels deep (the top level is 1)."""
    # Level by level, each level one comprehension: half the time of a stack of (node, depth) pairs
    # on a 100k-token chat body, where nearly every value is a string.
    if not isinstance(value, _CONTAINERS):
        return False
    level: list[Any] = [value]
    depth = 1
    while level:
        if depth > limit:
            return True
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, _CONTAINERS)
        ]
        depth += 1
    return False


_CONTAINERS = (dict, list)


def too_many(what: str, count: int, limit: int, setting: str, param: str, code: str) -> ProxyError:
    """The 400 for a list longer than its bound, naming the ``setting`` to raise."""
    return ProxyError(
        400, f"too many {what}: {count}, the limit is {limit} ({setting})", param=param, code=code
    )


def check_bounds(body: dict[str, Any], bounds: Bounds = DEFAULT_BOUNDS, *, messages: bool = True) -> None:
    """Raise a 400 ``ProxyError`` when ``body`` has too many messages (``messages``: it has a
    ``messages`` list) or tools, or nests too deep."""
    max_messages, max_tools, max_depth = bounds.max_messages, bounds.max_tools, bounds.max_json_depth
    if messages:
        listed = body.get("messages")
        if isinstance(listed, list) and len(listed) > max_messages:
            raise too_many(
                "messages", len(listed), max_messages, "max_messages", "messages", "too_many_messages"
            )
    tools = body.get("tools")
    if isinstance(tools, list) and len(tools) > max_tools:
        raise too_many("tools", len(tools), max_tools, "max_tools", "tools", "too_many_tools")
    if json_depth_exceeds(body, max_depth):
        raise ProxyError(
            400,
            f"request body nests arrays and objects more than {max_depth} levels deep (max_json_depth)",
            code="too_deeply_nested",
        )
