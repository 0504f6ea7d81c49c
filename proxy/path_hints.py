"""The hint a 404 gives when the path is one of prefixgate's with its ``/v1`` missing or doubled:
the usual mistake of a client's base URL (an OpenAI SDK's must end in ``/v1``; Anthropic's SDK adds
``/v1`` itself). The request still gets its 404: a path is never silently served as another."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.routing import BaseRoute, Match

PREFIX = "/v1"


def _served(routes: Iterable[BaseRoute], method: str, path: str) -> bool:
    """Whether some route serves ``path`` (for any method: a 405 there is still the right path)."""
    scope = {"type": "http", "method": method, "path": path, "root_path": ""}
    return any(route.matches(scope)[0] is not Match.NONE for route in routes)


def missing_prefix_hint(routes: Iterable[BaseRoute], method: str, path: str, base_url: str) -> str | None:
    """``; did you mean ...`` for a ``path`` served once its ``/v1`` is added or its doubled ``/v1``
    taken away (``base_url``: prefixgate's own, as the client reached it); None otherwise."""
    base = base_url.rstrip("/")
    routes = list(routes)
    if path.startswith(f"{PREFIX}{PREFIX}/"):
        meant = path.removeprefix(PREFIX)
        if _served(routes, method, meant):
            return (
                f"; did you mean {meant}? the client's base URL ends in /v1 and it adds its own: "
                f"set base_url to {base} (Anthropic's SDK), or check the path it appends"
            )
        return None
    if path.startswith(f"{PREFIX}/"):
        return None
    meant = PREFIX + path
    if _served(routes, method, meant):
        return f"; did you mean {meant}? set base_url to {base}{PREFIX} (an OpenAI client's ends in /v1)"
    return None
