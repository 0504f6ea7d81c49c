"""The wait order a replay saw: how often a later arrival took room while an earlier session waited.

From each session's latest admission record (``/admin/sessions/{id}``: ``at``, when it was admitted,
``waited_s`` and its ``decision``; its arrival is ``at - waited_s``), a session *i* that waited and
a session *j* that arrived after it and took a seat (``room``, ``released`` or ``rotated``) before *i*
was seated is one *overtake*. A session whose latest record is its park (``parked``) is left out:
that record says when it gave up its seat, not when it took one. Within one replica the queue's
head-of-line rule leaves none, so with N replicas on one machine (one clock) the overtakes counted
are across replicas. The table keeps each session's latest admission: a session admitted anew after
ending counts at its last.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import httpx

PAGE = 1000


def admission_records(url: str) -> list[dict[str, Any]]:
    """Every session's latest admission record, as the replica at ``url`` reads the table."""
    records: list[dict[str, Any]] = []
    with httpx.Client(base_url=url, timeout=30) as client:
        offset = 0
        while True:
            page = client.get("/admin/sessions", params={"limit": PAGE, "offset": offset}).json()
            for row in page["data"]:
                shown = client.get(f"/admin/sessions/{quote(row['id'], safe='')}")
                admission = shown.json().get("admission") if shown.status_code == 200 else None
                if admission and admission.get("at") is not None:
                    records.append(admission)
            offset += PAGE
            if offset >= page["total"]:
                return records


def overtakes(records: list[dict[str, Any]]) -> int:
    """Pairs (earlier waiter, later arrival that took a seat before it)."""
    seated = [r for r in records if r["decision"] != "parked"]
    spans = [(r["at"] - r["waited_s"], r["at"], r["waited_s"]) for r in seated]
    count = 0
    for arrived, admitted, waited in spans:
        if waited <= 0:
            continue
        for other_arrived, other_admitted, _ in spans:
            if arrived < other_arrived and other_admitted < admitted:
                count += 1
    return count


def wait_order(url: str) -> dict[str, Any]:
    """The figures of the replay behind ``url``: sessions, those that waited, overtakes, and the
    latest decisions by kind (``room``, ``released``, ``rotated``, ``parked``) with the seconds waited."""
    records = admission_records(url)
    decisions: dict[str, dict[str, float]] = {}
    for r in records:
        kind = decisions.setdefault(r["decision"], {"sessions": 0, "waited": 0, "waited_s": 0.0})
        kind["sessions"] += 1
        kind["waited"] += r["waited_s"] > 0
        kind["waited_s"] += r["waited_s"]
    return {
        "admitted_sessions": len(records),
        "waited": sum(1 for r in records if r["waited_s"] > 0),
        "overtakes": overtakes(records),
        "decisions": decisions,
    }
