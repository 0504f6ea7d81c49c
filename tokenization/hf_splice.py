"""Whether a Hugging Face tokenizer may re-encode an edited turn from a cut inside a message.

``HfTokenizer`` re-encodes a returning turn from the last added token (a turn header such as
``<|im_start|>``) before the first changed character: after it, tokenization starts afresh whatever
the tokenizer. An agent that edits its last message near the end (a reminder dropped, a tool result
cut) then has that whole message encoded again, ~10k tokens a turn for a long tool result.
``tokenization/edited.py`` names the cuts where cl100k's pre-tokenizer always starts a piece,
deciding the pieces before them from no character past them; the same holds for the pre-tokenizers
``splices`` accepts, so such a cut inside the common prefix keeps the previous turn's tokens before
it. Accepted, read from ``tokenizer.json``:

- a BPE model (merges never cross a pre-tokenized piece);
- no normalizer, or NFC (a cut falls on an ASCII character, which composes with nothing before it);
- as pre-tokenizer, byte-level BPE with GPT-2's pattern (``ByteLevel`` with ``use_regex``: a letter
  run takes at most a space before it, and ends at the first non-letter; whitespace runs end before
  a letter), or a ``Split`` on cl100k's pattern (Llama 3) or Qwen2's (the same, one digit a piece)
  followed by a ``ByteLevel`` without its own regex;
- no added token with a cut position inside its text (added tokens are split out of the text before
  pre-tokenization: a cut inside one would split it).

Anything else (Metaspace / SentencePiece, WordPiece, other patterns or normalizers) keeps the cut at
the last added token: exact for every tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tokenization.edited import fresh_start

#: Llama 3's pre-tokenizer pattern: cl100k_base's.
CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: Qwen2's (and its successors'): cl100k's with one digit a piece.
QWEN2_PATTERN = CL100K_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")
_PATTERNS = frozenset({CL100K_PATTERN, QWEN2_PATTERN})


def splices(config: Mapping[str, Any]) -> bool:
    """Whether ``config`` (a parsed ``tokenizer.json``) is a tokenizer whose encoding may start
    afresh at ``tokenization.edited.fresh_start``'s cuts (see the module docstring)."""
    model = config.get("model") or {}
    normalizer = config.get("normalizer")
    if model.get("type") != "BPE" or not (normalizer is None or normalizer.get("type") == "NFC"):
        return False
    if not _pre_tokenizer_splits(config.get("pre_tokenizer")):
        return False
    return not any(_holds_a_cut(token.get("content", "")) for token in config.get("added_tokens") or ())


def _pre_tokenizer_splits(pre: Any) -> bool:
    if not isinstance(pre, Mapping):
        return False
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space", False)
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not isinstance(steps, list) or len(steps) != 2:
        return False
    split, byte_level = steps
    pattern = (split.get("pattern") or {}).get("Regex") if isinstance(split, Mapping) else None
    return (
        split.get("type") == "Split"
        and pattern in _PATTERNS
        and split.get("behavior") == "Isolated"
        and not split.get("invert", False)
        and isinstance(byte_level, Mapping)
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
        and not byte_level.get("add_prefix_space", False)
    )


def _holds_a_cut(text: str) -> bool:
    """Whether a cut position lies strictly inside ``text``."""
    return any(fresh_start(text, c) for c in range(1, len(text)))
