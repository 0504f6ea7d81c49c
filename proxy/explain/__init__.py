"""The prefix-break explainer (told by the pipeline's ending), in ``explainer.py``: the previous turn
a session's next is compared with, the breaks it detects, the request part that changed, the causes
and records."""

from __future__ import annotations

from proxy.explain.explainer import (
    CACHE_SALT_CHANGED,
    EVICTED,
    HISTORY_DROPPED,
    HISTORY_EDITED,
    MOVED,
    PROMPT_EDITED,
    REASONING_CHANGED,
    SYSTEM_EDITED,
    TOOLS_ADDED,
    TOOLS_CHANGED,
    TOOLS_REMOVED,
    TOOLS_REORDERED,
    UNKNOWN,
    Explainer,
    Turn,
    extends,
)

__all__ = [
    "CACHE_SALT_CHANGED",
    "EVICTED",
    "HISTORY_DROPPED",
    "HISTORY_EDITED",
    "MOVED",
    "PROMPT_EDITED",
    "REASONING_CHANGED",
    "SYSTEM_EDITED",
    "TOOLS_ADDED",
    "TOOLS_CHANGED",
    "TOOLS_REMOVED",
    "TOOLS_REORDERED",
    "UNKNOWN",
    "Explainer",
    "Turn",
    "extends",
]
