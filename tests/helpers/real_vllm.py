"""Workloads and probes for the real-vLLM tier: agent-like sessions, a KV-event tap, a simple mirror.

Used by ``tests/vllm`` (and ``tests/explain`` for its tools). Everything here talks to loopback only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import zmq

from tests.vllm.ranks import SERVED_MODEL


def path_tool(name: str, description: str, path_description: str | None = None) -> dict[str, Any]:
    """A chat function tool taking one required ``path`` string, as coding agents declare them."""
    path: dict[str, Any] = {"type": "string"}
    if path_description is not None:
        path["description"] = path_description
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": {"path": path}, "required": ["path"]},
        },
    }


TOOLS: list[dict[str, Any]] = [
    path_tool("read_file", "Read a file of the repository and return its text."),
    path_tool("write_file", "Replace a file of the repository with new text."),
    path_tool("run_tests", "Run the test suite and return the failures."),
    path_tool("grep", "Search the repository for a regular expression."),
]

_FILE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n\n" * 3


def agent_turns(nonce: str, turns: int, *, date_drift: bool = False) -> Iterator[tuple[list[dict], list]]:
    """``(messages, tools)`` of each turn of one coding-agent session; each turn extends the last.

    ``date_drift``: the system prompt carries a clock that moves every turn and the tools come in a
    rotating order, the two drifts agents show most (what canonicalization is for).
    """
    system = f"You are a coding agent working in repository {nonce}. Read files before editing them."
    history: list[dict[str, Any]] = [{"role": "user", "content": f"The tests of {nonce} fail. Fix area()."}]
    for turn in range(turns):
        sys_text = system
        tools = TOOLS
        if date_drift:
            sys_text = f"{system}\nThe current date is 2025-08-28 14:{turn:02d}:{(7 * turn) % 60:02d}."
            shift = turn % len(TOOLS)
            tools = TOOLS[shift:] + TOOLS[:shift]
        yield [{"role": "system", "content": sys_text}, *history], tools
        call_id = f"call_{turn}"
        history.append(
            {
                "role": "assistant",
                "content": f"Step {turn}: reading the code.",
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "read_file", "arguments": f'{{"path": "src/m{turn}.py"}}'},
                    }
                ],
            }
        )
        history.append({"role": "tool", "tool_call_id": call_id, "content": f"# src/m{turn}.py\n{_FILE}"})
        history.append(
            {"role": "user", "content": [{"type": "text", "text": f"Continue with step {turn + 1}."}]}
        )


@dataclass(frozen=True, slots=True)
class TurnResult:
    """One chat request's answer: who served it, what the rank reported, what prefixgate estimated."""

    #: The rank that answered (``x-prefixgate-backend``; None without prefixgate in front).
    rank: str | None
    prompt_tokens: int
    cached_tokens: int
    estimated: int | None


def chat(
    client: httpx.Client,
    base_url: str,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    *,
    session: str | None = None,
    max_tokens: int = 2,
    **extra: Any,
) -> TurnResult:
    """POST one non-streamed chat completion; raises on a non-200 answer."""
    body: dict[str, Any] = {"model": SERVED_MODEL, "messages": list(messages), "max_tokens": max_tokens}
    body["temperature"] = 0.0
    if tools:
        body["tools"] = list(tools)
    body.update(extra)
    headers = {"x-session-id": session} if session else {}
    response = client.post(f"{base_url}/v1/chat/completions", json=body, headers=headers)
    response.raise_for_status()
    usage = response.json()["usage"]
    details = usage.get("prompt_tokens_details") or {}
    estimated = response.headers.get("x-prefixgate-estimated-cached-tokens")
    return TurnResult(
        response.headers.get("x-prefixgate-backend"),
        usage["prompt_tokens"],
        int(details.get("cached_tokens") or 0),
        int(estimated) if estimated is not None else None,
    )


def hit_tokens(leading_blocks: int, num_tokens: int, block_size: int) -> int:
    """Tokens vLLM reports as cached for ``leading_blocks`` held blocks: never the last prompt token."""
    return min(leading_blocks, (num_tokens - 1) // block_size) * block_size


@dataclass
class SimpleMirror:
    """Per rank, the block hashes of every prompt sent there (history only: no eviction, no events)."""

    blocks: dict[str, set[bytes]] = field(default_factory=dict)

    def estimate(self, rank: str, hashes: Sequence[bytes], num_tokens: int, block_size: int) -> int:
        """Cached tokens the rank should report for a prompt with these block hashes."""
        held = self.blocks.get(rank, set())
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return hit_tokens(n, num_tokens, block_size)

    def record(self, rank: str, hashes: Sequence[bytes]) -> None:
        self.blocks.setdefault(rank, set()).update(hashes)


@dataclass(frozen=True, slots=True)
class StoredBlocks:
    """One ``BlockStored`` event as published (uint64 hashes)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int


class KVTap:
    """Subscribes to one rank's KV-event PUB in a thread and keeps every ``BlockStored`` it sees."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.stored: list[StoredBlocks] = []
        self.removed: list[int] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-tap", daemon=True)

    def __enter__(self) -> KVTap:
        self._thread.start()
        if not self._ready.wait(5.0):
            raise RuntimeError(f"KV tap on {self.endpoint} did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)

    def _run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        # A SUB's subscription reaches the PUB asynchronously: batches published before it does are
        # dropped, so give it a moment before the caller sends requests.
        self._stop.wait(0.3)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                frames = sock.recv_multipart()
                # [topic, seq, payload]; payload = msgpack [ts, events, dp_rank]
                batch = msgspec.msgpack.decode(frames[-1])
                with self._changed:
                    for event in batch[1]:
                        self._add(event)
                    self._changed.notify_all()
        finally:
            sock.close(0)

    def _add(self, event: Any) -> None:
        if isinstance(event, dict):  # vLLM >= 0.12: maps with a "type" key
            kind = event.get("type")
            if kind == "BlockStored":
                self.stored.append(
                    StoredBlocks(
                        list(event["block_hashes"]),
                        event.get("parent_block_hash"),
                        list(event["token_ids"]),
                        int(event["block_size"]),
                    )
                )
            elif kind == "BlockRemoved":
                self.removed.extend(event["block_hashes"])
        elif event and event[0] == "BlockStored":  # 0.11: positional arrays
            self.stored.append(StoredBlocks(list(event[1]), event[2], list(event[3]), int(event[4])))
        elif event and event[0] == "BlockRemoved":
            self.removed.extend(event[1])

    def stored_hashes(self) -> list[int]:
        """Every stored block hash so far, in publication order."""
        with self._changed:
            return [h for s in self.stored for h in s.block_hashes]

    def wait_for(self, hashes: Sequence[int], timeout: float = 10.0) -> bool:
        """Wait until every hash of ``hashes`` has been published as stored."""
        want = set(hashes)
        with self._changed:
            return self._changed.wait_for(
                lambda: want <= {h for s in self.stored for h in s.block_hashes}, timeout
            )
