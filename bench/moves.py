"""Why sessions left their rank, read from prefixgate's own log lines (``proxy/stages/route.py``:
"session S turn N moved A -> B: reason", logged at INFO): each move recomputes the session's
context on the new rank, so a benchmark that counts sessions on two ranks says which rule moved them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable

MOVE = re.compile(r"session (?P<session>\S+) turn -?\d+ moved \S+ -> \S+: (?P<reason>.*)")

#: The reasons ``Router._log_move`` gives, by the words each begins with.
KINDS = (
    ("admitted anew", "admitted anew"),
    ("its rank is down", "rank down or failed"),
    ("saturated", "home saturated"),
    ("over the load bound", "over the load bound"),
)


def kind(reason: str) -> str:
    """The rule a move's logged reason names (the reason's first words when it names none known)."""
    return next((name for prefix, name in KINDS if reason.startswith(prefix)), " ".join(reason.split()[:4]))


def moves(logs: Iterable[str]) -> dict[str, dict[str, int]]:
    """Moves and moved sessions by rule, over the logs of every replica."""
    counted: Counter[str] = Counter()
    sessions: dict[str, set[str]] = {}
    for log in logs:
        for line in log.splitlines():
            found = MOVE.search(line)
            if found is None:
                continue
            rule = kind(found["reason"])
            counted[rule] += 1
            sessions.setdefault(rule, set()).add(found["session"])
    return {rule: {"moves": n, "sessions": len(sessions[rule])} for rule, n in counted.most_common()}
