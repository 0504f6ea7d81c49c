"""A local Hugging Face model's tokenizer (``tokenizer.json``) and chat template, without transformers.

Chat templates cannot be split per message in general, so each turn renders the whole prompt text
(cheap) and re-encodes only from a safe boundary: the start of the last added (special) token that
lies wholly inside the prefix shared with the previous turn's text. Added tokens are split out of
the text before normalization and pre-tokenization, so the tokens before such a token never depend
on what follows it, and the text after it is encoded as its own piece either way.
"""

from __future__ import annotations

import bisect
import contextlib
import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HfCoreTokenizer

from tokenization.base import ChatPrompt, Encoded, Part, Plan, common_prefix_len
from tokenization.hf_template import load_chat_template, render_chat, select_template

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class _TextMemo:
    text: str  # the rendered prompt
    starts: array  # char offset where each token starts ("I")
    anchors: array  # indices of added-token tokens, ascending ("I")
    anchor_ends: array  # char offset where each anchor ends ("I")


def vllm_messages(messages: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Messages as vLLM hands them to an HF template: text-part lists joined with newlines (the
    "string" content format) and tool call ``arguments`` strings parsed into objects."""
    out: list[Mapping[str, Any]] = []
    for message in messages:
        content = message.get("content")
        tool_calls = message.get("tool_calls")
        if not isinstance(content, list) and not (isinstance(tool_calls, list) and tool_calls):
            out.append(message)
            continue
        copy = dict(message)
        if isinstance(content, list):
            copy["content"] = "\n".join(
                p["text"] if isinstance(p, Mapping) and isinstance(p.get("text"), str) else str(p)
                for p in content
            )
        if isinstance(tool_calls, list):
            copy["tool_calls"] = [_parsed_call(call) for call in tool_calls]
        out.append(copy)
    return out


def _parsed_call(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    fn = dict(call["function"])
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        # Unparseable arguments stay as sent: the template renders the raw string.
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(arguments) if arguments else {}
    return {**call, "function": fn}


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

    def encode_text(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text`` (from scratch)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

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
        messages = prompt.messages

        def finish() -> Encoded:
            enc = self._tok.encode(text[cut_char:] if cut_char else text, add_special_tokens=False)
            ids = enc.ids
            if memo is not None and prev is not None and cut_token:
                tokens = prev.tokens[:cut_token]
                starts = memo.starts[:cut_token]
                anchors = memo.anchors[: bisect.bisect_left(memo.anchors, cut_token)]
                anchor_ends = memo.anchor_ends[: len(anchors)]
            else:
                tokens, starts, anchors, anchor_ends = array("I"), array("I"), array("I"), array("I")
            added = self._added_ids
            for i, (tid, (_, end)) in enumerate(zip(ids, enc.offsets, strict=True)):
                if tid in added:
                    anchors.append(cut_token + i)
                    anchor_ends.append(cut_char + end)
            starts.fromlist([cut_char + o[0] for o in enc.offsets])
            tokens.fromlist(ids)
            reused = cut_token
            if prev is not None and memo is not None:
                reused += common_prefix_len(prev.tokens[cut_token:], ids)
            parts = message_parts(text, messages, starts, anchors, len(tokens))
            memo_bytes = len(text) + 4 * (len(starts) + 2 * len(anchors)) + 200
            return Encoded(tokens, parts, reused, _TextMemo(text, starts, anchors, anchor_ends), memo_bytes)

        return Plan((len(text) - cut_char) // CHARS_PER_TOKEN, finish)

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None = None) -> Plan:
        """A completion prompt, with the tokenizer's special tokens added (vLLM's completions default)."""
        del model

        def finish() -> Encoded:
            tokens = array("I", self._tok.encode(text, add_special_tokens=True).ids)
            reused = 0 if prev is None else common_prefix_len(prev.tokens, tokens)
            return Encoded(tokens, (("prompt", 0, len(tokens)),), reused)

        return Plan(len(text) // CHARS_PER_TOKEN, finish)


def message_parts(
    text: str, messages: Sequence[Mapping[str, Any]], starts: array, anchors: array, num_tokens: int
) -> tuple[Part, ...]:
    """Approximate token spans per message: each message starts at the last added token (its turn
    header, e.g. ``<|im_start|>``) before its content's first occurrence in the rendered text.
    Messages whose content cannot be located join the previous part."""
    bounds: list[tuple[str, int]] = []
    pos = 0
    last_token = 0
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, str) or not content:
            continue
        at = text.find(content, pos)
        if at < 0:
            continue
        pos = at + len(content)
        token = bisect.bisect_right(starts, at) - 1
        k = bisect.bisect_right(anchors, token) - 1
        if k >= 0 and anchors[k] >= last_token:
            token = anchors[k]
        if bounds and token <= bounds[-1][1]:
            continue
        bounds.append((f"message[{i}]", token))
        last_token = token
    if not bounds or bounds[0][1] > 0:
        bounds.insert(0, ("prelude", 0))
    ends = [b[1] for b in bounds[1:]] + [num_tokens]
    return tuple((label, start, end) for (label, start), end in zip(bounds, ends, strict=True))
