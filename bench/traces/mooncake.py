"""Mooncake traces (``*.jsonl[.gz]``: global ids, 512-token blocks, no session ids) as conversations.

Requests that re-send an earlier request are grouped into conversations (``infer_mooncake_sessions``),
each arriving at its first request's ``timestamp``; ids are global, so requests sharing leading ids
share the leading text exactly, within a conversation or across.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.traces.sessions import TraceRequest, TraceSession
from bench.traces.sources import TracesMissing, open_text


@dataclass(frozen=True, slots=True)
class MooncakeLine:
    """One line of a Mooncake trace: arrival (ms), lengths and global block ids."""

    timestamp_ms: float
    input_tokens: int
    output_tokens: int
    ids: tuple[int, ...]


def read_mooncake(path: str | Path) -> list[MooncakeLine]:
    """Every request of a Mooncake JSONL file (``.gz`` or plain), in file order."""
    path = Path(path)
    if not path.exists():
        raise TracesMissing(
            f"Mooncake trace {path} not found: the shared traces folder (../shared/traces) "
            "is not on this machine"
        )
    out: list[MooncakeLine] = []
    with open_text(path) as handle:
        for line in handle:
            if not line.strip():
                continue
            item = json.loads(line)
            out.append(
                MooncakeLine(
                    timestamp_ms=float(item.get("timestamp") or 0.0),
                    input_tokens=int(item.get("input_length") or 0),
                    output_tokens=int(item.get("output_length") or 0),
                    ids=tuple(int(i) for i in item.get("hash_ids") or ()),
                )
            )
    return out


_BRANCHED = -1  # successor mark: more than one distinct block has followed this one


def infer_mooncake_sessions(lines: Sequence[MooncakeLine]) -> list[list[int]]:
    """Group a Mooncake trace's requests into conversations (lists of line indexes, by first arrival).

    Mooncake ids are chained (an id fixes the whole prefix up to its block), so a request's longest
    prefix seen before ends at one block, last sent by one earlier request P. The request continues
    P's conversation when it re-sends all of P except at most P's last block (the trace hashes the
    partial last block too, so the next turn replaces it) and P is that conversation's latest request,
    unless that block is a branch point: once two different blocks have followed it, it is a prefix
    many conversations share (a system prompt, a document asked about twice), and a request matching
    only up to it starts a conversation of its own. Such shared prefixes still hit across
    conversations: their text is the same (ids are global).
    """
    owner: dict[int, int] = {}  # block id -> the latest line that sent it
    successor: dict[int, int] = {}  # block id -> the one block that followed it, or _BRANCHED
    session_of: list[int] = []
    latest: list[int] = []  # session -> its latest line
    sessions: list[list[int]] = []
    for index, line in enumerate(lines):
        ids = line.ids
        shared = 0
        while shared < len(ids) and ids[shared] in owner:
            shared += 1
        session = -1
        if shared:
            parent = owner[ids[shared - 1]]
            candidate = session_of[parent]
            if (
                latest[candidate] == parent
                and shared >= len(lines[parent].ids) - 1
                and successor.get(ids[shared - 1]) != _BRANCHED
            ):
                session = candidate
        if session < 0:
            session = len(sessions)
            sessions.append([])
            latest.append(index)
        sessions[session].append(index)
        session_of.append(session)
        latest[session] = index
        # Pairs before the shared block were recorded when their ids were first sent (ids are chained).
        for i in range(max(shared - 1, 0), len(ids) - 1):
            seen = successor.get(ids[i])
            if seen is None:
                successor[ids[i]] = ids[i + 1]
            elif seen != ids[i + 1]:
                successor[ids[i]] = _BRANCHED
        for block in ids:
            owner[block] = index
    return sessions


def common_head(lines: Sequence[MooncakeLine]) -> int:
    """Leading blocks every request of the trace starts with (a global system prompt), 0 if none."""
    if len(lines) < 2:
        return 0
    head = lines[0].ids
    for line in lines[1:]:
        n = 0
        for a, b in zip(head, line.ids, strict=False):
            if a != b:
                break
            n += 1
        head = head[:n]
        if not head:
            break
    return len(head)


def load_mooncake(
    path: str | Path,
    limit: int | None = None,
    block_tokens: int = 512,
    max_prompt_tokens: int | None = None,
    max_requests: int | None = None,
) -> list[TraceSession]:
    """Mooncake JSONL (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``) as conversations.

    The format has no session ids: ``infer_mooncake_sessions`` groups requests that re-send a previous
    one into conversations. Each starts at its first request's arrival (seconds since the trace's
    first line); a later request's think time is the gap between its arrival and the previous one's
    (the trace's arrival times include the previous answer). Leading blocks common to every request
    of the file form the system message. Ids are global, so requests sharing leading ids share their
    leading text, within a conversation or across.

    ``limit`` keeps about that many conversations without losing what they share: conversations come
    in families (those that share a prefix beyond the file's common head, e.g. one document asked
    about in several conversations), and whole families are taken in order of first arrival until
    ``limit`` conversations are reached. Cutting the file after N lines instead keeps almost none of
    its reuse: later turns and re-reads arrive minutes later. ``max_prompt_tokens`` skips a
    conversation with a longer request and ``max_requests`` keeps the first requests of each.
    Conversations are returned in order of arrival.
    """
    lines = read_mooncake(path)
    head = common_head(lines)
    families: dict[object, list[list[int]]] = {}  # insertion order: first arrival
    for indexes in infer_mooncake_sessions(lines):
        ids = lines[indexes[0]].ids
        # Ids are chained, so the first block after the head names the whole tree below it.
        root: object = ids[head] if len(ids) > head else ("line", indexes[0])
        families.setdefault(root, []).append(indexes)
    first_ms = lines[0].timestamp_ms if lines else 0.0
    out: list[TraceSession] = []
    for family in families.values():
        if limit is not None and len(out) >= limit:
            break
        for indexes in family:
            if max_prompt_tokens is not None and any(
                lines[i].input_tokens > max_prompt_tokens for i in indexes
            ):
                continue
            out.append(_mooncake_session(lines, indexes[:max_requests], head, first_ms, block_tokens))
    out.sort(key=lambda session: session.start_s)
    return out


def _mooncake_session(
    lines: Sequence[MooncakeLine], indexes: Sequence[int], head: int, first_ms: float, block_tokens: int
) -> TraceSession:
    requests: list[TraceRequest] = []
    previous_ms: float | None = None
    for i in indexes:
        line = lines[i]
        requests.append(
            TraceRequest(
                blocks=tuple(("mooncake", block) for block in line.ids),
                input_tokens=line.input_tokens or len(line.ids) * block_tokens,
                output_tokens=line.output_tokens,
                think_time_s=0.0 if previous_ms is None else (line.timestamp_ms - previous_ms) / 1000,
                t_s=(line.timestamp_ms - first_ms) / 1000,
            )
        )
        previous_ms = line.timestamp_ms
    return TraceSession(
        key=f"mooncake-{indexes[0]}", requests=requests, head_blocks=head, start_s=requests[0].t_s
    )
