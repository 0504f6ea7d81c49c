"""A local Hugging Face model's tokenizer (``tokenizer.json``) and chat template, without transformers.

Chat templates cannot be split per message in general, so each turn renders the whole prompt text
(cheap) and re-encodes only from a safe boundary: the start of the last added (special) token that
lies wholly inside the prefix shared with the previous turn's text. Added tokens are split out of
the text before normalization and pre-tokenization, so the tokens before such a token never depend
on what follows it, and the text after it is encoded as its own piece either way. For the byte-level
BPE tokenizers ``tokenization/hf_splice.py`` accepts (GPT-2's, Llama 3's and Qwen2's pre-tokenizers),
a message edited near its end is re-encoded from a later cut inside it, where tokenization also
starts afresh (``tokenization/edited.py``), once ``min_edit_kept`` characters of it are unchanged.
"""

from __future__ import annotations

import bisect
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HfCoreTokenizer

from tokenization.base import (
    ChatPrompt,
    Encoded,
    Plan,
    TextSize,
    UnsupportedRequest,
    common_prefix_len,
    whole_prompt,
)
from tokenization.chat_conversion import BILLING_HEADER_PREFIX
from tokenization.edited import MIN_KEPT_CHARS, last_fresh_start
from tokenization.hf_parts import Walk, message_parts
from tokenization.hf_splice import splices
from tokenization.hf_starts import ASCII_PROBE, StartTable, added_positions
from tokenization.hf_template import load_chat_template, render_chat, select_template


@dataclass(frozen=True, slots=True)
class _TextMemo:
    text: str  # the rendered prompt
    starts: array  # char offset where each token starts ("I")
    anchors: array  # indices of added-token tokens, ascending ("I")
    anchor_ends: array  # char offset where each anchor ends ("I")
    walk: Walk  # how its messages were located (``tokenization.hf_parts``)


#: Keys vLLM keeps of an incoming message, per role (``renderers/chat_utils.py``: the message is
#: rebuilt from these; anything else a client sends never reaches the template).
_KEPT_KEYS: dict[str, frozenset[str]] = {
    "assistant": frozenset({"role", "content", "tool_calls", "reasoning", "name", "task"}),
    "tool": frozenset({"role", "content", "tool_call_id", "name", "task"}),
    "developer": frozenset({"role", "content", "name", "task", "tools"}),
}
_DEFAULT_KEPT = frozenset({"role", "content", "name", "task"})
#: Content part types whose text vLLM joins into the content string, and the key holding it.
_TEXT_PART_KEYS = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
}


def vllm_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Messages as vLLM (0.32) hands them to an HF template with string content.

    Each message keeps only the keys vLLM keeps for its role; text parts are joined with newlines
    (parts without text are skipped); ``content: null`` becomes ``""``; a system text part (or
    string) starting with Claude Code's billing header loses that line; an empty ``tool_calls``
    list is dropped; tool call ``arguments`` become objects (strings parsed as JSON; empty,
    malformed or non-object arguments become ``{}``, as vLLM coerces them). Messages that need
    none of this are passed through without a copy. Raises ``UnsupportedRequest`` for shapes vLLM
    rejects or that need a multimodal model (non-text parts).
    """
    out: list[Mapping[str, Any]] = []
    for message in messages:
        role = message.get("role")
        content = message.get("content")
        kept = _KEPT_KEYS.get(role, _DEFAULT_KEPT) if isinstance(role, str) else _DEFAULT_KEPT
        plain = (
            isinstance(content, str)
            and message.keys() <= kept
            and "tool_calls" not in message
            and "reasoning" not in message
            and role != "developer"
            and not (role == "system" and content.startswith(BILLING_HEADER_PREFIX))
            and all(isinstance(message[k], str) for k in ("name", "task") if k in message)
        )
        out.append(message if plain else _vllm_message(message, role, content))
    return out


def _vllm_message(message: Mapping[str, Any], role: Any, content: Any) -> dict[str, Any]:
    parts: list[Any]
    if content is None:
        parts = []
    elif isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        raise UnsupportedRequest("message 'content' must be a string, a list of parts or null")
    if role == "system":
        parts = _strip_billing_header(parts)
    texts: list[str] = []
    for part in parts:
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        key = _TEXT_PART_KEYS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise UnsupportedRequest("non-text content parts need the rank's own tokenizer")
        text = part.get(key)
        if text is not None:  # vLLM skips a text part without text
            texts.append(text)
    copy: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
    if role == "assistant":
        calls = message.get("tool_calls")
        if calls is not None:
            if not isinstance(calls, list):
                raise UnsupportedRequest("'tool_calls' must be a list")
            if calls:
                copy["tool_calls"] = [_parsed_call(call) for call in calls]
        reasoning = message.get("reasoning")
        if reasoning is not None:
            copy["reasoning"] = copy["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in message:
        copy["tool_call_id"] = message["tool_call_id"]
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            copy[key] = message[key]
    if role == "developer":
        copy["tools"] = message.get("tools")
    return copy


def _strip_billing_header(parts: list[Any]) -> list[Any]:
    out: list[Any] = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, Mapping) else None
        if not (isinstance(text, str) and text.startswith(BILLING_HEADER_PREFIX)):
            out.append(part)
            continue
        rest = text.partition("\n")[2]
        if rest:
            out.append(rest if isinstance(part, str) else {**part, "text": rest})
    return out


def _parsed_call(call: Any) -> dict[str, Any]:
    if not isinstance(call, Mapping):
        raise UnsupportedRequest("assistant 'tool_calls' entries must be objects")
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, Mapping):
        raise UnsupportedRequest("only tool calls of type 'function' are supported")
    arguments = fn.get("arguments")
    parsed: Any = arguments
    if isinstance(arguments, str) and arguments:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
    # vLLM hands templates an object whatever was sent: empty, malformed or non-object -> {}.
    if not isinstance(parsed, Mapping):
        parsed = {}
    return {**call, "function": {**fn, "arguments": parsed}}


class HfTokenizer:
    """``tokenizer.json`` + chat template of a local model directory: the token ids vLLM would build."""

    kind = "hf"

    def __init__(self, model_dir: str | Path, chat_template: str | Path | None = None) -> None:
        self.model_dir = Path(model_dir)
        self._tok = HfCoreTokenizer.from_file(str(self.model_dir / "tokenizer.json"))
        self._templates, self._special = load_chat_template(
            self.model_dir, Path(chat_template) if chat_template is not None else None
        )
        self._added_ids = frozenset(self._tok.get_added_tokens_decoder())
        config = json.loads(self._tok.to_str())  # the loaded tokenizer's own configuration
        #: Whether an edited message may be re-encoded from a cut inside it rather than from its turn
        #: header (``tokenization/hf_splice.py``).
        self.splices = splices(config) and self._offsets_tile()
        #: Token starts computed from the ids, without the library's offsets (``tokenization/hf_starts.py``);
        #: None: this tokenizer's offsets are read from the library.
        self.starts = StartTable.of(self._tok, config)
        #: Unchanged leading characters the changed region needs before such a cut is looked for.
        self.min_edit_kept = MIN_KEPT_CHARS
        #: Characters per token of what it encoded: sizes a prompt before it is encoded.
        self.size = TextSize()

    def _offsets_tile(self) -> bool:
        """Whether token offsets cover the text edge to edge (a token's start is where its text
        starts; offsets trimmed of whitespace would not say which token starts at a cut)."""
        probe = ASCII_PROBE
        offsets = self._tok.encode_batch([probe], add_special_tokens=False)[0].offsets
        edges = [edge for span in offsets for edge in span]
        return (
            bool(edges)
            and edges[0] == 0
            and edges[-1] == len(probe)
            and all(edges[i] == edges[i + 1] for i in range(1, len(edges) - 1, 2))
        )

    def render(self, prompt: ChatPrompt) -> str:
        """The prompt text the template produces."""
        source = select_template(self._templates, bool(prompt.tools))
        return render_chat(
            source,
            vllm_messages(prompt.messages),
            prompt.tools,
            prompt.add_generation_prompt,
            self._special,
            prompt.chat_template_kwargs,
        )

    def token_id(self, token: str) -> int | None:
        """The id of one vocabulary entry (a special token such as ``<|im_start|>``), or None."""
        found = self._tok.token_to_id(token)
        return found if isinstance(found, int) else None

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of ``ids``."""
        return str(self._tok.decode(ids, skip_special_tokens))

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (from scratch)."""
        return self._ids(text, add_special_tokens)

    # The batch calls release the GIL while they encode (``encode`` holds it throughout): a long
    # first turn in a worker thread then leaves the event loop running.
    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        ids: list[int] = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        self.size.learn(len(text), len(ids))
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> Any:
        """The library's encoding of ``text``, offsets included."""
        encoded = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        self.size.learn(len(text), len(encoded.ids))
        return encoded

    def _encode_piece(self, piece: str, base: int) -> tuple[list[int], array, list[int], list[int]]:
        """``piece``'s ids; where each token starts (``base`` + its character offset, ``array("I")``);
        which tokens are added tokens (``<|im_start|>``), and where each of those ends."""
        table = self.starts
        computed = table.encode(piece, base) if table is not None else None
        if table is not None and computed is not None:
            ids, starts = computed
            self.size.learn(len(piece), len(ids))
            found = added_positions(ids, self._added_ids)
            return ids, starts, found, [starts[i] + table.length(ids[i]) for i in found]
        encoded = self._encode(piece, False)
        ids = encoded.ids
        offsets = encoded.offsets  # built anew on each read: read once
        found = added_positions(ids, self._added_ids)
        starts = array("I", [base + start for start, _ in offsets])
        return ids, starts, found, [base + offsets[i][1] for i in found]

    def encode_chat(self, prompt: ChatPrompt, prev: Encoded | None = None) -> Encoded:
        """Synchronous ``plan_chat(...).finish()``."""
        return self._plan_chat(prompt, prev).finish()

    async def plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        """Render inline; ``finish`` re-encodes from the safe boundary before the first changed char."""
        return self._plan_chat(prompt, prev)

    def _plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        text = self.render(prompt)
        memo = prev.memo if prev is not None and isinstance(prev.memo, _TextMemo) else None
        cut_token, cut_char = 0, 0
        if memo is not None:
            same = common_prefix_len(memo.text, text)
            # Last anchor wholly inside the shared prefix; the text from its start is re-encoded.
            k = bisect.bisect_right(memo.anchor_ends, same) - 1
            if k >= 0:
                cut_token = memo.anchors[k]
                cut_char = memo.starts[cut_token]
            if self.splices and same - cut_char >= self.min_edit_kept:
                cut_token, cut_char = _later_cut(memo.starts, text, same, cut_token, cut_char)
        messages = prompt.messages

        def finish() -> Encoded:
            piece = text[cut_char:] if cut_char else text
            ids, new_starts, found, found_ends = self._encode_piece(piece, cut_char)
            if memo is not None and prev is not None and cut_token:
                tokens = prev.tokens[:cut_token]
                starts = memo.starts[:cut_token]
                anchors = memo.anchors[: bisect.bisect_left(memo.anchors, cut_token)]
                anchor_ends = memo.anchor_ends[: len(anchors)]
            else:
                tokens, starts, anchors, anchor_ends = array("I"), array("I"), array("I"), array("I")
            anchors.extend([cut_token + i for i in found])
            anchor_ends.extend(found_ends)
            starts.extend(new_starts)
            tokens.fromlist(ids)
            reused = 0
            walk = None
            if prev is not None and memo is not None:  # tokens[:cut_token] are prev's: compare after
                reused = common_prefix_len(prev.tokens, tokens, start=cut_token)
                walk = memo.walk if cut_token else None
            parts, walk = message_parts(text, messages, starts, anchors, len(tokens), walk, cut_char)
            memo_bytes = len(text) + 4 * (len(starts) + 2 * len(anchors)) + walk.nbytes + 200
            encoded_memo = _TextMemo(text, starts, anchors, anchor_ends, walk)
            return Encoded(tokens, parts, reused, encoded_memo, memo_bytes)

        return Plan(self.size.tokens(len(text) - cut_char), finish, kept=cut_token)

    def prepare_thread(self) -> None:
        """Nothing is kept per thread."""

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None = None) -> Plan:
        """A completion prompt, with the tokenizer's special tokens added (vLLM's completions default)."""
        del model

        def finish() -> Encoded:
            return whole_prompt(array("I", self._ids(text, True)), prev)

        return Plan(self.size.tokens(len(text)), finish)


def _later_cut(starts: array, text: str, same: int, cut_token: int, cut_char: int) -> tuple[int, int]:
    """A cut past ``cut_char`` where the encoding starts afresh and a previous token starts (the
    previous turn's tokens before it are this turn's): ``(token, char)``; the given cut without one."""
    at = last_fresh_start(text, same)
    if at <= cut_char:
        return cut_token, cut_char
    token = bisect.bisect_left(starts, at)
    if token < len(starts) and starts[token] == at:
        return token, at
    return cut_token, cut_char
