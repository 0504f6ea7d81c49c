"""Public agent traces as chat sessions: Claude Code (JSON per conversation) and Mooncake (JSONL).

A trace gives, per request, one id per block of input tokens (equal ids: identical block and
identical prefix up to it). A proxy sees text, so each id maps to a fixed chunk of text of exactly
one trace block of cl100k tokens (``BlockText``: the same id always gives the same text), and each
session's requests become OpenAI chat bodies where a request that extends the previous one re-sends
the previous messages unchanged and appends its new blocks as new messages.

- Claude Code (``claude-code/trace_*.json.gz``, ids local to a trace): the first
  ``(tool_tokens + system_tokens) // block_size`` blocks of every trace get one shared set of ids
  (sessions of one agent version share their system prompt and tools), rendered as the system
  message; sub-agents are sessions of their own with their own shared head per sub-agent type.
- Mooncake (``*.jsonl[.gz]``, global ids, 512-token blocks, no session ids): requests that re-send
  an earlier request are grouped into conversations (``infer_mooncake_sessions``), each arriving at
  its first request's ``timestamp``; ids are global, so requests sharing leading ids share the
  leading text exactly, within a conversation or across.

``prefix_units`` describes a body as a sequence of hashable units with their token counts (template
framing and block chunks), which lets ``UnitCacheBound`` compute the replay's infinite-cache bound
without re-tokenizing hundreds of thousands of tokens per request.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from tokenization.chatml import IM_END, IM_START
from tokenization.encoding import encode

#: Where the shared traces live, relative to the project root (read in place, never copied).
SHARED_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
CLAUDE_CODE_DIR = SHARED_TRACES / "claude-code"
MOONCAKE_DIR = SHARED_TRACES / "mooncake"

# Every word is one cl100k token with its leading space, so a chunk of N words is exactly N tokens
# and chunks concatenate without merging across their boundary.
_WORDS = str.split(
    "the of and to in is that for it as with was on be by this are from or at an have not but which all "
    "can one has were more their will if about other into time only some would new also these two any "
    "may first after use been over when such like most very between code file data test value error "
    "system type function return class import model cache block token request session prefix router "
    "rank pool config retry stream chunk header parse render hash route forward update list string "
    "float true false async await path line diff patch assert result output input context window agent "
    "tool call argument schema property name object array index buffer self none module package build "
    "check run start stop read write open close send receive load save find match print log debug warn "
    "info user server client query table column row key map set get put post delete create remove add "
    "change fix bug issue review merge branch commit push pull"
)
VOCABULARY: tuple[str, ...] = tuple(" " + w for w in _WORDS)


class TracesMissing(FileNotFoundError):
    """The shared traces folder (or a named trace file) is not on this machine."""


BlockKey = tuple[str, int]  # (namespace, id): ids are only unique within their namespace


class BlockText:
    """Deterministic text for block ids: ``text(key)`` is exactly ``block_tokens`` cl100k tokens."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        self.block_tokens = block_tokens
        self.seed = seed
        self._cache: dict[BlockKey, str] = {}

    def text(self, key: BlockKey) -> str:
        """The chunk of ``key`` (a ``(namespace, id)`` pair); the same key always gives the same text."""
        chunk = self._cache.get(key)
        if chunk is None:
            digest = xxhash.xxh3_64_intdigest(f"{self.seed}\x00{key[0]}\x00{key[1]}".encode())
            chunk = "".join(random.Random(digest).choices(VOCABULARY, k=self.block_tokens))
            self._cache[key] = chunk
        return chunk

    def join(self, keys: Iterable[BlockKey]) -> str:
        return "".join(self.text(k) for k in keys)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its blocks, output length and the client's wait before sending it."""

    blocks: tuple[BlockKey, ...]
    input_tokens: int
    output_tokens: int
    think_time_s: float = 0.0
    t_s: float = 0.0


@dataclass
class TraceSession:
    """One conversation of a trace, replayed in order; ``children`` run as sessions of their own.

    ``children`` maps a request index to the sub-agent sessions the parent starts (and waits for)
    before sending that request. ``head_blocks`` leading blocks form the system message.
    """

    key: str
    requests: list[TraceRequest]
    head_blocks: int = 0
    start_s: float = 0.0
    children: dict[int, list[TraceSession]] = field(default_factory=dict)

    def all_sessions(self) -> Iterator[TraceSession]:
        yield self
        for subs in self.children.values():
            for sub in subs:
                yield from sub.all_sessions()

    @property
    def max_input_tokens(self) -> int:
        return max((r.input_tokens for r in self.requests), default=0)


@dataclass
class _Message:
    role: str
    blocks: tuple[BlockKey, ...]
    body: dict[str, Any]


class ChatBuilder:
    """Turns one session's requests into chat bodies, re-sending kept messages unchanged.

    A request keeps the longest run of the previous request's messages whose blocks are all a prefix
    of its own blocks, then appends the rest of its blocks as new messages: first the previous
    answer's blocks as an assistant message, then the remainder as a user message.
    """

    def __init__(self, session: TraceSession, text: BlockText, block_tokens: int) -> None:
        self.session = session
        self.text = text
        self.block_tokens = block_tokens
        self.messages: list[_Message] = []

    def messages_for(self, index: int) -> list[_Message]:
        """The messages of request ``index`` (call in order: each builds on the previous one)."""
        request = self.session.requests[index]
        blocks = request.blocks
        kept: list[_Message] = []
        covered = 0
        for message in self.messages:
            end = covered + len(message.blocks)
            if end > len(blocks) or blocks[covered:end] != message.blocks:
                break
            kept.append(message)
            covered = end
        if not kept and self.session.head_blocks and len(blocks) > self.session.head_blocks:
            kept.append(self._message("system", blocks[: self.session.head_blocks]))
            covered = self.session.head_blocks
        rest = blocks[covered:]
        if rest:
            previous = self.session.requests[index - 1] if index else None
            answer = 0
            if previous is not None and len(kept) == len(self.messages) and len(rest) > 1:
                answer = min(len(rest) - 1, -(-previous.output_tokens // self.block_tokens))
            if answer:
                kept.append(self._message("assistant", rest[:answer]))
            kept.append(self._message("user", rest[answer:]))
        self.messages = kept
        return kept

    def body(self, index: int, model: str, max_tokens: int, stream: bool = True) -> dict[str, Any]:
        """The OpenAI chat body of request ``index``."""
        body: dict[str, Any] = {
            "model": model,
            "messages": [m.body for m in self.messages_for(index)],
            "max_tokens": max_tokens,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _message(self, role: str, blocks: tuple[BlockKey, ...]) -> _Message:
        return _Message(role, blocks, {"role": role, "content": self.text.join(blocks)})

    def units(self) -> list[tuple[Hashable, int]]:
        """The last built request as (unit, tokens) pairs, in prompt order (see ``UnitCacheBound``)."""
        out: list[tuple[Hashable, int]] = []
        for message in self.messages:
            out.append((("start", message.role), _header_tokens(message.role)))
            out.extend((key, self.block_tokens) for key in message.blocks)
            out.append((("end",), _END_TOKENS))
        out.append((("start", "assistant"), _header_tokens("assistant")))  # the generation prompt
        return out


_HEADER_TOKENS: dict[str, int] = {}
_END_TOKENS = len(encode(IM_END + "\n"))


def _header_tokens(role: str) -> int:
    count = _HEADER_TOKENS.get(role)
    if count is None:
        count = _HEADER_TOKENS[role] = len(encode(f"{IM_START}{role}\n"))
    return count


class UnitCacheBound:
    """Infinite-cache bound over unit sequences: one rank, unlimited pool, requests in sent order.

    A request's hits are its longest prefix of units seen before in any request, in tokens, rounded
    down to whole KV blocks and leaving the last prompt token to compute (as vLLM does).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[int] = set()
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def add(self, units: Sequence[tuple[Hashable, int]]) -> tuple[int, int]:
        """Account one request; returns its (prompt tokens, hit tokens)."""
        chain = 0
        matched = 0
        total = 0
        hitting = True
        for unit, tokens in units:
            chain = hash((chain, unit))
            if hitting and chain in self._seen:
                matched += tokens
            else:
                hitting = False
                self._seen.add(chain)
            total += tokens
        hittable = (total - 1) // self.block_size * self.block_size
        hits = min(matched // self.block_size * self.block_size, hittable)
        self.prompt_tokens += total
        self.hit_tokens += hits
        return total, hits

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def trace_block_reuse(sessions: Iterable[TraceSession]) -> float:
    """The traces' own reuse figure: blocks whose prefix was seen before, over all blocks."""
    seen: set[int] = set()
    total = reused = 0
    for session in sessions:
        for request in session.requests:
            chain = 0
            for key in request.blocks:
                chain = hash((chain, key))
                if chain in seen:
                    reused += 1
                else:
                    seen.add(chain)
                total += 1
    return reused / total if total else 0.0


def reuse_breakdown(sessions: Sequence[TraceSession]) -> dict[str, float]:
    """Where the traces' block reuse comes from, as fractions of all blocks (they add up to the reuse).

    Requests are taken in order of ``t_s`` (a clock common to all sessions, as Mooncake's): ``head``
    is reuse of the sessions' leading ``head_blocks`` (a prefix every rank holds after its first
    request, whatever the routing), ``same_session`` of blocks the session itself sent before (what
    sticky routing keeps), ``across_sessions`` of blocks only other sessions sent before (what only
    prefix-aware routing finds).
    """
    requests = sorted(
        ((r.t_s, n, s.key, s.head_blocks, r.blocks) for n, s in enumerate(sessions) for r in s.requests),
        key=lambda item: (item[0], item[1]),
    )
    seen: set[int] = set()
    own: dict[str, set[int]] = {}
    head = same = across = total = 0
    for _, _, key, head_blocks, blocks in requests:
        mine = own.setdefault(key, set())
        chain = 0
        for position, block in enumerate(blocks):
            chain = hash((chain, block))
            total += 1
            if position < head_blocks and chain in seen:
                head += 1
            elif chain in mine:
                same += 1
            elif chain in seen:
                across += 1
            seen.add(chain)
            mine.add(chain)
    if not total:
        return {"head": 0.0, "same_session": 0.0, "across_sessions": 0.0}
    return {"head": head / total, "same_session": same / total, "across_sessions": across / total}


def _open_json(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)


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


def load_claude_code_trace(path: str | Path) -> TraceSession:
    """One Claude Code conversation (``trace_*.json[.gz]``) with its sub-agents as child sessions."""
    path = Path(path)
    if not path.exists():
        raise TracesMissing(f"trace file {path} not found")
    data = _open_json(path)
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


INDEX_CACHE = Path.home() / ".cache" / "prefixgate" / "claude-code-index.json"


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
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[MooncakeLine] = []
    with opener(path, "rt") as handle:
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
