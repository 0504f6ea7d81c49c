"""Claude Code traces (``claude-code/trace_*.json[.gz]``, one JSON per conversation) as sessions.

Ids are local to a trace. The first ``(tool_tokens + system_tokens) // block_size`` blocks of every
trace get one shared set of ids (sessions of one agent version share their system prompt and tools),
rendered as the system message; sub-agents are sessions of their own with their own shared head per
sub-agent type.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.traces.sessions import TraceRequest, TraceSession
from bench.traces.sources import CLAUDE_CODE_DIR, TracesMissing, open_text

#: Largest request per trace file, cached by file size and mtime (parsing all files takes seconds).
INDEX_CACHE = Path.home() / ".cache" / "prefixgate" / "claude-code-index.json"


def load_claude_code_trace(path: str | Path) -> TraceSession:
    """One Claude Code conversation (``trace_*.json[.gz]``) with its sub-agents as child sessions."""
    path = Path(path)
    if not path.exists():
        raise TracesMissing(f"trace file {path} not found")
    with open_text(path) as handle:
        data = json.load(handle)
    block_size = int(data.get("block_size") or 64)
    if block_size != 64:
        raise ValueError(f"{path}: expected 64-token blocks, got {block_size}")
    trace_id = str(data.get("id") or path.name.split(".")[0])
    head = (int(data.get("tool_tokens") or 0) + int(data.get("system_tokens") or 0)) // block_size
    return _session_from_requests(trace_id, data["requests"], head, trace_id, "shared", 0.0)


def claude_code_paths(directory: str | Path = CLAUDE_CODE_DIR) -> list[Path]:
    """The trace files of the Claude Code folder, sorted; ``TracesMissing`` when it is absent."""
    directory = Path(directory)
    paths = sorted(directory.glob("trace_*.json*"))
    if not paths:
        raise TracesMissing(
            f"no Claude Code traces in {directory}: the shared traces folder (../shared/traces) is not "
            "on this machine; use the built-in synthetic workload (`prefixgate demo`) instead"
        )
    return paths


def load_claude_code(
    directory: str | Path = CLAUDE_CODE_DIR,
    max_prompt_tokens: int | None = None,
    limit: int | None = None,
    max_requests: int | None = None,
) -> list[TraceSession]:
    """Claude Code conversations in file order.

    ``max_prompt_tokens`` skips conversations with a longer request than this anywhere in the trace
    (sub-agents included: they cannot fit a rank's pool or context); ``max_requests`` then keeps the
    first requests of each;
    ``limit`` stops after that many conversations.
    """
    out: list[TraceSession] = []
    paths = claude_code_paths(directory)
    if max_prompt_tokens is not None:
        # Parsing all 200 files takes seconds; a cached index of their largest request skips most.
        largest = _largest_request_index(paths)
        paths = [p for p in paths if largest[str(p.resolve())] <= max_prompt_tokens]
    for path in paths:
        session = load_claude_code_trace(path)
        if max_requests is not None:
            _truncate(session, max_requests)
        if not session.requests:
            continue
        out.append(session)
        if limit is not None and len(out) >= limit:
            break
    return out


def _session_from_requests(
    key: str, raw: Sequence[dict[str, Any]], head: int, namespace: str, shared: str, start_s: float
) -> TraceSession:
    session = TraceSession(key=key, requests=[], head_blocks=head, start_s=start_s)
    sub_index = 0
    for item in raw:
        if item.get("type") == "subagent":
            sub_raw = item.get("requests") or []
            if not sub_raw:
                continue
            sub_type = str(item.get("subagent_type") or "agent")
            sub_head = (int(item.get("tool_tokens") or 0) + int(item.get("system_tokens") or 0)) // 64
            sub = _session_from_requests(
                f"{key}/{item.get('agent_id') or sub_index}",
                sub_raw,
                sub_head,
                f"{namespace}/sub{sub_index}",
                f"shared-sub-{sub_type}",
                float(item.get("t") or 0.0),
            )
            sub_index += 1
            session.children.setdefault(len(session.requests), []).append(sub)
            continue
        ids = item.get("hash_ids") or []
        blocks = tuple((shared, i) if i < head else (namespace, ids[i]) for i in range(len(ids)))
        session.requests.append(
            TraceRequest(
                blocks=blocks,
                input_tokens=int(item.get("in") or len(ids) * 64),
                output_tokens=int(item.get("out") or 0),
                think_time_s=float(item.get("think_time") or 0.0),
                t_s=float(item.get("t") or 0.0),
            )
        )
    return session


def _largest_request_index(paths: Sequence[Path]) -> dict[str, int]:
    """Resolved path -> largest request (sub-agents included), cached by file size and mtime."""
    try:
        cached = json.loads(INDEX_CACHE.read_text())
    except (OSError, ValueError):
        cached = {}
    out: dict[str, int] = {}
    changed = False
    for path in paths:
        stat = path.stat()
        stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
        key = str(path.resolve())
        entry = cached.get(key)
        if entry is None or entry[0] != stamp:
            session = load_claude_code_trace(path)
            entry = [stamp, max(s.max_input_tokens for s in session.all_sessions())]
            cached[key] = entry
            changed = True
        out[key] = entry[1]
    if changed:
        try:
            INDEX_CACHE.parent.mkdir(parents=True, exist_ok=True)
            INDEX_CACHE.write_text(json.dumps(cached))
        except OSError:  # a read-only home only costs the next run the parse again
            pass
    return out


def _truncate(session: TraceSession, max_requests: int) -> None:
    del session.requests[max_requests:]
    session.children = {i: subs for i, subs in session.children.items() if i < max_requests}
    for subs in session.children.values():
        for sub in subs:
            _truncate(sub, max_requests)
