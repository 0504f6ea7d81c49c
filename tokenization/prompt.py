"""Per-session incremental rendering and block hashing: what the proxy's "render and hash blocks" calls.

A coding agent's turn N+1 re-sends turn N plus a few messages. A turn's ``PromptBlocks`` carries a
``memo`` of it (the ``Encoded`` tokens + the tokenizer's memo, and its block hashes); given the
previous turn's memo, the next turn encodes only what changed (the tokenizer reports how many
leading tokens are unchanged) and hashes only the blocks from the first changed one, chaining from
the cached parent (``PromptBlocks``: a prompt as the rank will cache it; ``PromptMemo``: what the
next turn starts from; ``PromptHead``: the part a turn is routed on before its whole prompt is
tokenized). The caller keeps the memo per session: the proxy on the session's local state
(``proxy.state.local``), standalone users in ``IncrementalTokenizer.sessions`` through
``blocks_for_chat(session_key, ...)``. Everything cached is immutable, so concurrent requests of
one session never see a half-updated state; the last one to finish wins the slot.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import threading
from array import array
from collections.abc import Awaitable, Callable, Hashable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from tokenization.base import (
    DEFAULT_SHARED_CACHE_BYTES,
    ChatPrompt,
    Encoded,
    Head,
    Part,
    Plan,
    Tokenizer,
    UnsupportedRequest,
    token_ids_plan,
)
from tokenization.block_hash import BlockHash, ChainHasher, kv_event_hash
from tokenization.lru import LRU

_T = TypeVar("_T")

#: Token ids fit vLLM's (and the token array's) 32 bits; a larger one is not a token.
_TOKEN_ID_LIMIT = 1 << 32
# Per cached block hash: the bytes object header (33) + list slot (8) on top of the digest.
_HASH_OVERHEAD = 41
# A shared-cache entry's key and tuple, on top of its hashes.
_SHARED_ENTRY_BYTES = 200


#: A returning turn's tail of fewer tokens (estimated) is encoded on the request's path: encoding it
#: costs less than the task that would carry it beside the request.
LOOP_TOKENS = 128


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt as the rank will cache it. ``tokens`` and ``block_hashes`` are shared: do not mutate."""

    num_tokens: int
    block_size: int
    block_hashes: Sequence[BlockHash]  # full blocks only, chained from block 0
    parts: tuple[Part, ...]  # (label, first token, end token), covering [0, num_tokens)
    #: Typecode "I"; the prompt's ids are its first ``num_tokens`` (all of them, but for a returning
    #: turn's kept blocks, which share the previous turn's array: ``PromptHead``).
    tokens: array
    reused_tokens: int = 0  # leading tokens taken from the session's previous turn without re-encoding
    reused_blocks: int = 0  # leading block hashes taken from the previous turn
    shared_blocks: int = 0  # leading block hashes taken from the cross-session cache (not hashed here)
    #: Leading tokens of the segment sessions of one agent share (system prompt + tools), as the
    #: tokenizer marks it (``Encoded.shared_tokens``): the prompt's *head*.
    shared_tokens: int = 0
    #: What the next turn of this session starts from (``IncrementalTokenizer.chat_blocks``), and
    #: about how many bytes it holds.
    memo: PromptMemo | None = None
    memo_bytes: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def part_at(self, token_index: int) -> str | None:
        """Label of the request part holding ``token_index`` (e.g. the first token of a broken block)."""
        i = bisect.bisect_right(self.parts, token_index, key=_part_start) - 1
        if i >= 0 and self.parts[i][1] <= token_index < self.parts[i][2]:
            return self.parts[i][0]
        return None

    def head(self) -> tuple[str | None, int]:
        """The head in full blocks: (its key, its tokens), or (None, 0) without one. The key is the
        hex of the head's last block hash, which (chained) names the whole head and its salt: the one
        identity of an agent's system + tools, the same for every session of that agent."""
        full = min(self.shared_tokens // self.block_size, len(self.block_hashes))
        if full == 0:
            return None, 0
        last = self.block_hashes[full - 1]
        return (last.hex() if isinstance(last, bytes) else str(last)), full * self.block_size

    def kv_event_hashes(self) -> list[int]:
        """The uint64 form vLLM publishes in KV events."""
        return [kv_event_hash(h) for h in self.block_hashes]


@dataclass(frozen=True, slots=True)
class PromptMemo:
    """One turn as the next turn of its session reuses it."""

    kind: str  # "chat" or "text": an Encoded is only a valid base for the same kind
    encoded: Encoded
    salt: str | None
    hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class PromptHead:
    """A turn as routing can see it before the whole prompt is tokenized: a session's first turn by
    its head (``IncrementalTokenizer.first_chat_blocks``: ``blocks`` covers the head alone, its
    ``shared_tokens`` are all its tokens), a returning turn by the blocks it keeps of the previous
    turn (``returning_chat_blocks``). ``blocks`` has no memo; ``estimated_tokens`` sizes the whole
    prompt from its text; ``rest()`` tokenizes and hashes the whole prompt (reusing those blocks).
    ``on_loop``: ``rest()`` is a short tail's work, done on the calling event loop (no worker-thread
    hop) while the request waits for its rank, so it lands before the rank can answer."""

    blocks: PromptBlocks
    estimated_tokens: int
    rest: Callable[[], Awaitable[PromptBlocks]]
    on_loop: bool = False


def _part_start(part: Part) -> int:
    return part[1]


class SessionCache(LRU[str, PromptMemo]):
    """LRU over sessions with a byte budget (approximate: tokens, hashes and tokenizer memos).

    A turn larger than the whole budget is not kept (its session's previous turn is dropped)."""


#: Longest a worker thread waits for the pool's others to start while the threads are prepared.
PREPARE_WAIT_S = 10.0


class IncrementalTokenizer:
    """Renders requests into block hashes, reusing each session's previous turn.

    One instance per backend group (one tokenizer, one block size, one hash algorithm). CPU-heavy
    uncached work (above ``offload_tokens`` estimated tokens) runs in a worker thread so a 100k-token
    first turn does not stall the event loop; small increments run inline. A returning turn goes on
    with the blocks it keeps while its tail is encoded: in a worker thread when it added more than
    ``ahead_tokens`` (default: ``offload_tokens``), else, from ``loop_tokens``, on the event loop while
    the request waits for its rank (``returning_chat_blocks``). ``executor`` is the pool that work
    runs in (``prefixgate serve``: one thread per core, for tokenizers that release the GIL while they
    encode, as tiktoken does); None: the event loop's default executor.

    Besides the per-session cache, ``shared`` keeps the block hashes of leading segments that many
    sessions share (``Encoded.shared_tokens``, e.g. one agent's system prompt + tools), keyed by
    those tokens and the salt: a new session of a known agent hashes only its own messages.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        hasher: ChainHasher,
        *,
        cache_bytes: int = 256 * 1024 * 1024,
        offload_tokens: int = 8192,
        ahead_tokens: int | None = None,
        loop_tokens: int = LOOP_TOKENS,
        shared_cache_bytes: int = DEFAULT_SHARED_CACHE_BYTES,
        executor: Executor | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.executor = executor
        self.hasher = hasher
        self.block_size = hasher.block_size
        self.sessions = SessionCache(cache_bytes)
        self.offload_tokens = offload_tokens
        # Default: only work a worker thread would do anyway goes to one. Below that, the hop costs
        # more than it saves: measured on replayed Claude Code traces at 256 tokens, TTFT p99 +15 %
        # and proxy CPU +0.6 ms a request (three runs each, side by side).
        self.ahead_tokens = offload_tokens if ahead_tokens is None else ahead_tokens
        self.loop_tokens = loop_tokens
        self._hash_bytes = len(hasher.none_hash) + _HASH_OVERHEAD
        self.shared = LRU[tuple[bytes, int, str | None], tuple[BlockHash, ...]](shared_cache_bytes)
        # Heads being encoded, by the head's key and salt: a wave of new sessions of one agent
        # encodes and hashes its head once.
        self._heads: dict[tuple[Hashable, str | None], asyncio.Future[PromptBlocks | None]] = {}

    async def blocks_for_chat(self, session_key: str | None, body: Mapping[str, Any]) -> PromptBlocks:
        """``chat_blocks`` after the session's previous turn, kept in ``sessions``."""
        blocks = await self.chat_blocks(body, self._previous(session_key))
        self._remember(session_key, blocks)
        return blocks

    async def blocks_for_completion(self, session_key: str | None, body: Mapping[str, Any]) -> PromptBlocks:
        """``completion_blocks`` after the session's previous turn, kept in ``sessions``."""
        blocks = await self.completion_blocks(body, self._previous(session_key))
        self._remember(session_key, blocks)
        return blocks

    async def chat_blocks(self, body: Mapping[str, Any], previous: PromptMemo | None = None) -> PromptBlocks:
        """Blocks of an OpenAI chat request (``messages``, ``tools``, ``add_generation_prompt``,
        ``cache_salt``, ``chat_template_kwargs``), reusing ``previous`` (the memo of the session's
        previous turn). Raises ``UnsupportedRequest`` on a malformed body."""
        prompt = ChatPrompt.from_body(body)
        salt = _salt(body)
        prev = previous if previous is not None and previous.kind == "chat" else None
        plan = await self.tokenizer.plan_chat(prompt, prev.encoded if prev else None)
        return await self._complete("chat", plan, prev, salt)

    async def first_chat_blocks(self, body: Mapping[str, Any]) -> PromptBlocks | PromptHead:
        """A session's first chat turn (no previous turn). When the tokenizer can give its head apart
        (``Plan.head``), the head is encoded and hashed once for every concurrent first turn of the
        agent (a wave of new sessions), and when what follows it is work for a worker thread (over
        ``offload_tokens``) the head is returned at once with the rest to finish (``PromptHead``), so
        that the turn can be routed before its whole prompt is tokenized. Else its blocks, as
        ``chat_blocks`` gives them."""
        prompt = ChatPrompt.from_body(body)
        salt = _salt(body)
        plan = await self.tokenizer.plan_chat(prompt, None)
        head = plan.head
        if head is not None and (head.work or plan.work - head.work > self.offload_tokens):
            blocks = await self._head_blocks(head, salt)
            if blocks is not None:
                rest = Plan(plan.work - head.work, plan.finish)  # the head's ids are cached now
                if rest.work <= self.offload_tokens:
                    return await self._complete("chat", rest, None, salt)
                estimated = blocks.num_tokens + rest.work
                return PromptHead(blocks, estimated, lambda: self._complete("chat", rest, None, salt))
        return await self._complete("chat", plan, None, salt)

    async def returning_chat_blocks(
        self, body: Mapping[str, Any], previous: PromptMemo, *, on_loop: bool = True
    ) -> PromptBlocks | PromptHead:
        """A session's returning chat turn. When it keeps some blocks of ``previous`` (``Plan.kept``)
        and adds a tail, those blocks are returned at once with the rest to finish (``PromptHead``):
        the turn is routed on what the ranks can hold of it (its new tail is in no rank's cache) and
        its tail is tokenized while the request is on its way: in a worker thread when over
        ``ahead_tokens``, else on the event loop (``PromptHead.on_loop``; with ``on_loop`` False,
        such a tail is encoded here). Else (nothing kept, or a tail under ``loop_tokens``) its
        blocks, as ``chat_blocks`` gives them."""
        prompt = ChatPrompt.from_body(body)
        salt = _salt(body)
        prev = previous if previous.kind == "chat" else None
        plan = await self.tokenizer.plan_chat(prompt, prev.encoded if prev else None)
        size = self.block_size
        keep = min(plan.kept // size, len(prev.hashes)) if prev is not None and prev.salt == salt else 0
        short = plan.work <= self.ahead_tokens  # the event loop's work, not a worker thread's
        if prev is None or keep == 0 or plan.work < self.loop_tokens or (short and not on_loop):
            return await self._complete("chat", plan, prev, salt)
        kept = keep * size
        blocks = PromptBlocks(
            num_tokens=kept,
            block_size=size,
            block_hashes=prev.hashes[:keep],
            parts=(("kept", 0, kept),),
            tokens=prev.encoded.tokens,  # its first ``kept``: shared, not copied (100k+ ids a turn)
            reused_tokens=kept,
            reused_blocks=keep,
            shared_tokens=min(prev.encoded.shared_tokens, kept),
        )
        base = prev  # a name for the closure: mypy narrows no captured variable

        def rest() -> Awaitable[PromptBlocks]:
            if short:
                return self._complete("chat", plan, base, salt)
            return self._run(None, self._complete_here, "chat", plan, base, salt)

        return PromptHead(blocks, plan.kept + plan.work, rest, on_loop=short)

    async def completion_blocks(
        self, body: Mapping[str, Any], previous: PromptMemo | None = None
    ) -> PromptBlocks:
        """Blocks of an OpenAI completion request whose ``prompt`` is a string or a list of token ids."""
        prompt = body.get("prompt")
        salt = _salt(body)
        prev = previous if previous is not None and previous.kind == "text" else None
        base = prev.encoded if prev else None
        if isinstance(prompt, str):
            model = body.get("model")
            plan = await self.tokenizer.plan_text(prompt, base, model if isinstance(model, str) else None)
        elif isinstance(prompt, list) and all(type(t) is int and 0 <= t < _TOKEN_ID_LIMIT for t in prompt):
            plan = token_ids_plan(prompt, base)
        else:
            raise UnsupportedRequest("'prompt' must be a string or a list of token ids")
        return await self._complete("text", plan, prev, salt)

    def _previous(self, session_key: str | None) -> PromptMemo | None:
        return self.sessions.get(session_key) if session_key is not None else None

    def _remember(self, session_key: str | None, blocks: PromptBlocks) -> None:
        if session_key is not None and blocks.memo is not None:
            self.sessions.put(session_key, blocks.memo, blocks.memo_bytes)

    async def _complete(
        self, kind: str, plan: Plan, prev: PromptMemo | None, salt: str | None
    ) -> PromptBlocks:
        """``plan`` finished and hashed, each in a worker thread when large (``offload_tokens``)."""
        encoded = await self._run(plan.work, plan.finish)
        keep, shared = self._known_blocks(encoded, prev, salt)
        unhashed = len(encoded.tokens) - keep * self.block_size
        hashes = await self._run(unhashed, self._hash, encoded, prev, keep, salt, shared)
        return self._blocks(kind, encoded, salt, keep, shared, hashes)

    def _complete_here(
        self, kind: str, plan: Plan, prev: PromptMemo | None, salt: str | None
    ) -> PromptBlocks:
        """``_complete`` in the calling thread: a worker's, for a ``PromptHead``'s rest (one hop)."""
        encoded = plan.finish()
        keep, shared = self._known_blocks(encoded, prev, salt)
        return self._blocks(kind, encoded, salt, keep, shared, self._hash(encoded, prev, keep, salt, shared))

    def _known_blocks(
        self, encoded: Encoded, prev: PromptMemo | None, salt: str | None
    ) -> tuple[int, tuple[BlockHash, ...] | None]:
        """How many leading block hashes are known before hashing, and the shared ones among them."""
        keep = self._reusable_blocks(encoded, prev, salt)
        shared, keep = self._shared_blocks(encoded, prev, keep, salt)
        return keep, shared

    def _blocks(
        self,
        kind: str,
        encoded: Encoded,
        salt: str | None,
        keep: int,
        shared: tuple[BlockHash, ...] | None,
        hashes: list[BlockHash],
    ) -> PromptBlocks:
        return PromptBlocks(
            num_tokens=len(encoded.tokens),
            block_size=self.block_size,
            block_hashes=hashes,
            parts=encoded.parts,
            tokens=encoded.tokens,
            reused_tokens=encoded.reused,
            reused_blocks=keep if shared is None else 0,
            shared_blocks=0 if shared is None else keep,
            shared_tokens=encoded.shared_tokens,
            memo=PromptMemo(kind, encoded, salt, hashes),
            memo_bytes=encoded.nbytes + len(hashes) * self._hash_bytes + 200,
        )

    async def _head_blocks(self, head: Head, salt: str | None) -> PromptBlocks | None:
        """The head's blocks (None: under one block), encoded and hashed once for concurrent callers."""
        key = (head.key, salt)
        pending = self._heads.get(key)
        if pending is None:
            pending = self._heads[key] = asyncio.ensure_future(self._encode_head(head, salt))
            pending.add_done_callback(
                lambda done: self._heads.pop(key, None) if self._heads.get(key) is done else None
            )
        return await asyncio.shield(pending)

    async def _encode_head(self, head: Head, salt: str | None) -> PromptBlocks | None:
        tokens = await self._run(head.work, head.encode)
        lead = len(tokens) // self.block_size
        if lead == 0:
            return None
        key = self._shared_key(tokens, lead, salt)
        hashes = self.shared.get(key)
        if hashes is None:
            hashed = await self._run(
                lead * self.block_size, lambda: self.hasher.hash_blocks(tokens, cache_salt=salt)
            )
            hashes = tuple(hashed)
            self._put_shared(key, hashes)
        return PromptBlocks(
            num_tokens=len(tokens),
            block_size=self.block_size,
            block_hashes=hashes,
            parts=(("head", 0, len(tokens)),),
            tokens=tokens,
            shared_blocks=lead,
            shared_tokens=len(tokens),
        )

    async def prepare_threads(self, threads: int) -> None:
        """Set up what the tokenizer keeps per thread on this thread and on ``threads`` threads of
        the executor (the pool's size), before the first turns need it: with tiktoken, each
        thread's encoding (~50 ms of CPU each), else built inside the first burst of first turns.
        Each task waits at a barrier until all have started, so each runs on a thread of its own."""
        self.tokenizer.prepare_thread()  # the event loop's thread first: it owns the shared encoding
        if self.executor is None or threads <= 0:
            return
        started = threading.Barrier(threads)

        def prepare() -> None:
            # a pool smaller than asked breaks the barrier at the timeout: its threads still prepare
            with contextlib.suppress(threading.BrokenBarrierError):
                started.wait(timeout=PREPARE_WAIT_S)
            self.tokenizer.prepare_thread()

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self.executor, prepare) for _ in range(threads)))

    async def _run(self, work: int | None, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, in a worker thread when ``work`` (tokens) exceeds ``offload_tokens`` or is
        None (work beside a request on its way)."""
        if work is not None and work <= self.offload_tokens:
            return fn(*args)
        if self.executor is None:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _shared_blocks(
        self, encoded: Encoded, prev: PromptMemo | None, keep: int, salt: str | None
    ) -> tuple[tuple[BlockHash, ...] | None, int]:
        """The cross-session hashes of the shared leading blocks when they beat the session's own
        reuse, and the number of leading blocks then known: ``(None, keep)`` otherwise."""
        lead = encoded.shared_tokens // self.block_size
        if lead <= keep:
            return None, keep
        cached = self.shared.get(self._shared_key(encoded.tokens, lead, salt))
        if cached is None:
            return None, keep
        return cached, lead

    def _shared_key(self, tokens: array, lead: int, salt: str | None) -> tuple[bytes, int, str | None]:
        # The hashes depend only on these tokens and the salt (the hasher is this instance's).
        view = memoryview(tokens)[: lead * self.block_size]
        return xxhash.xxh3_128_digest(view), lead, salt

    def _store_shared(self, encoded: Encoded, hashes: list[BlockHash], salt: str | None) -> None:
        lead = min(encoded.shared_tokens // self.block_size, len(hashes))
        if lead:
            self._put_shared(self._shared_key(encoded.tokens, lead, salt), tuple(hashes[:lead]))

    def _put_shared(self, key: tuple[bytes, int, str | None], hashes: tuple[BlockHash, ...]) -> None:
        self.shared.put(key, hashes, _SHARED_ENTRY_BYTES + len(hashes) * self._hash_bytes)

    def _reusable_blocks(self, encoded: Encoded, prev: PromptMemo | None, salt: str | None) -> int:
        # The salt sits in block 0's hash, so a changed salt changes every block.
        if prev is None or prev.salt != salt:
            return 0
        return min(encoded.reused // self.block_size, len(prev.hashes))

    def _hash(
        self,
        encoded: Encoded,
        prev: PromptMemo | None,
        keep: int,
        salt: str | None,
        shared: tuple[BlockHash, ...] | None = None,
    ) -> list[BlockHash]:
        """Hashes of every full block: the first ``keep`` from ``shared`` or the previous turn."""
        if keep == 0:
            hashes = self.hasher.hash_blocks(encoded.tokens, cache_salt=salt)
        else:
            base: Sequence[BlockHash] = shared if shared is not None else prev.hashes if prev else ()
            new = self.hasher.hash_blocks(
                encoded.tokens, start_block=keep, parent=base[keep - 1], cache_salt=salt
            )
            if not new and prev is not None and shared is None and keep == len(prev.hashes):
                hashes = prev.hashes  # the same blocks as the previous turn: its list, shared
            else:
                # one copy of the kept blocks, extended in place (10k of them on a long session)
                hashes = base[:keep] if isinstance(base, list) else list(base[:keep])
                hashes.extend(new)
        if shared is None and keep < encoded.shared_tokens // self.block_size:
            # The shared segment was hashed here (a first turn, a changed system prompt): keep it.
            self._store_shared(encoded, hashes, salt)
        return hashes


def _salt(body: Mapping[str, Any]) -> str | None:
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise UnsupportedRequest("'cache_salt' must be a string")
    return salt or None
