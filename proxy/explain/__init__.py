"""The prefix-break explainer (told by the pipeline's ending): ``explainer.py`` detects breaks,
``classify.py`` names the request part that changed, ``turns.py`` holds what a session's previous
turn is compared by, ``records.py`` the causes and records."""

from __future__ import annotations

from proxy.explain.explainer import Explainer
from proxy.explain.records import (
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
)
from proxy.explain.turns import Turn, extends

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
