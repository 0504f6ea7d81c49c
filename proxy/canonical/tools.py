"""The tool side of the engine: the tool steps over a request's ``tools``.

The ``ToolsRule`` steps are a pure function of the tools: their outcome is cached by a digest of the
raw tools' serialization, so an unchanged tool list costs a hash and a dict lookup. The
``SessionToolsRule`` steps (``tool_order``) then run on every request, with the session's state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

from proxy.canonical.messages import add_counts
from proxy.canonical.rules.base import SessionToolsStep, ToolList, ToolsStep
from proxy.canonical.state import SessionCanonState
from tokenization.lru import LRU


class ToolSteps:
    """The enabled tool rules of one rule set, compiled, in order, with the cache of their outcomes."""

    def __init__(
        self,
        steps: Sequence[tuple[str, ToolsStep]],
        session_steps: Sequence[tuple[str, SessionToolsStep]],
        cache_entries: int,
    ) -> None:
        self.steps = tuple(steps)
        self.session_steps = tuple(session_steps)
        self._cache: LRU[bytes, tuple[ToolList, tuple[tuple[str, int], ...]]] = LRU(cache_entries)

    def _cached(self, tools: list[Any], digest: bytes) -> tuple[ToolList, tuple[tuple[str, int], ...]]:
        hit = self._cache.get(digest)
        if hit is not None:
            return hit
        view = ToolList.of(tools)
        counts: list[tuple[str, int]] = []
        for name, step in self.steps:
            edit = step(view)
            view = edit.tools
            if edit.count:
                counts.append((name, edit.count))
        outcome = (view, tuple(counts))
        self._cache.put(digest, outcome)
        return outcome

    def apply(
        self, tools: list[Any], session: SessionCanonState | None, rewrites: dict[str, int]
    ) -> list[Any] | None:
        """The canonical tool list, or None when no step changes it; adds the rewrites made."""
        try:
            digest = xxhash.xxh3_128_digest(orjson.dumps(tools))
        except (TypeError, orjson.JSONEncodeError):
            return None  # not JSON-serializable as given (e.g. an integer over 64 bits): leave alone
        view, counts = self._cached(tools, digest)
        add_counts(rewrites, counts)
        changed = bool(counts)
        for name, session_step in self.session_steps:
            edit = session_step(view, session)
            if edit.count:
                view = edit.tools
                rewrites[name] = rewrites.get(name, 0) + edit.count
                changed = True
        return list(view.tools) if changed else None
