"""A trace session's requests as OpenAI chat bodies, and as prompt units for the cache bound.

A request that extends the previous one re-sends the previous messages unchanged and appends its new
blocks as new messages. ``ChatBuilder.units`` describes the last body built as a sequence of hashable
units with their token counts (template framing and block chunks), which lets
``bench.traces.reuse.UnitCacheBound`` compute the replay's infinite-cache bound without re-tokenizing
hundreds of thousands of tokens per request.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from bench.traces.blocks import BlockKey, BlockText
from bench.traces.sessions import TraceSession
from tokenization.tiktoken_tokenizer import IM_END, IM_START, encode


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
