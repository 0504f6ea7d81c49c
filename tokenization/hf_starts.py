"""Where each token of a byte-level BPE encoding starts in its text, computed from the token ids.

``HfTokenizer`` needs each token's start (a character offset) to cut, splice and split turns into
messages. The library's ``Encoding.offsets`` gives them, at a price: ``encode_batch`` tracks every
character's alignment through normalization and pre-tokenization, and each read of ``offsets`` builds
a tuple per token. On a ~16k-token tool result that is ~40 % of the encode (measured: 14-17 ms with
offsets, 9.6 ms with ``encode_batch_fast`` and the starts computed here).

For a byte-level BPE tokenizer the tokens' bytes are the text's UTF-8 bytes, in order, so the starts
follow from two numbers per vocabulary entry: how many characters begin in its bytes (``begun``:
the bytes that are not UTF-8 continuation bytes) and whether its first byte continues a character
begun in the token before it (``inside``). Token ``t`` then starts at ``sum(begun[:t]) - inside[t]``:
a token that begins inside a character starts where the library says it does, at that character.
Added tokens (``<|im_start|>``) are whole characters of their own text.

``StartTable.of`` builds the table only for tokenizers where this holds (a BPE model whose
pre-tokenizer ends in ``ByteLevel`` without an added prefix space, no normalizer or NFC), and only
when the library's own offsets on a probe (whitespace, multi-byte characters, added tokens) agree
with it. ``encode`` declines a text the table cannot account for (its characters do not add up, or
it is not NFC where the tokenizer normalizes), and the caller asks the library for offsets instead.
"""

from __future__ import annotations

import operator
import unicodedata
from array import array
from collections.abc import Mapping
from itertools import accumulate
from typing import Any

from tokenizers import Tokenizer as HfCoreTokenizer

#: ASCII text with runs of whitespace and punctuation: where offsets trimmed of whitespace show.
ASCII_PROBE = "a b\n c\t\td  e\n\nf, (g)  \n"
#: Text whose offsets the table must reproduce before it is used: ``ASCII_PROBE``, then two- to
#: four-byte characters (split across tokens by a small vocabulary) and digits.
PROBE = ASCII_PROBE + " x\u2192y caf\u00e9 \U0001f600! \u53f8\u9a6c 123\r\n"


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a vocabulary entry.

    Printable Latin-1 bytes stand for themselves; every other byte, in order, for 256, 257, ...
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(config: Mapping[str, Any]) -> bool:
    model = config.get("model") or {}
    normalizer = config.get("normalizer")
    if model.get("type") != "BPE" or not (normalizer is None or normalizer.get("type") == "NFC"):
        return False
    pre = config.get("pre_tokenizer") or {}
    last = (pre.get("pretokenizers") or [None])[-1] if pre.get("type") == "Sequence" else pre
    return isinstance(last, Mapping) and last.get("type") == "ByteLevel" and not last.get("add_prefix_space")


class StartTable:
    """Per vocabulary entry: characters begun in its bytes, and whether it begins inside one."""

    def __init__(self, tokenizer: HfCoreTokenizer, begun: list[int], inside: list[int], nfc: bool) -> None:
        self._tokenizer = tokenizer
        self._begun = begun
        self._inside = inside
        self._nfc = nfc

    @classmethod
    def of(cls, tokenizer: HfCoreTokenizer, config: Mapping[str, Any]) -> StartTable | None:
        """The table of ``tokenizer`` (``config``: its parsed ``tokenizer.json``), or None where the
        starts cannot be computed from the ids (see the module docstring)."""
        table = cls.build(tokenizer, config)
        if table is None:
            return None
        # Each added token between spaces: one that takes the whitespace beside it is caught here.
        added = tokenizer.get_added_tokens_decoder().values()
        probe = PROBE + " ".join(sorted(token.content for token in added)) + " end"
        encoding = tokenizer.encode_batch([probe], add_special_tokens=False)[0]
        computed = table.encode(probe, 0)
        if computed is None or computed[0] != encoding.ids:
            return None
        return table if list(computed[1]) == [start for start, _ in encoding.offsets] else None

    @classmethod
    def build(cls, tokenizer: HfCoreTokenizer, config: Mapping[str, Any]) -> StartTable | None:
        """The table as ``tokenizer``'s vocabulary gives it, not yet checked against the library's
        offsets; None for a tokenizer that is not byte-level BPE."""
        if not _is_byte_level(config):
            return None
        alphabet = byte_alphabet()
        added = {i: token.content for i, token in tokenizer.get_added_tokens_decoder().items()}
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        size = max(vocab.values(), default=-1) + 1
        begun, inside = [0] * size, [0] * size
        for entry, i in vocab.items():
            if i in added:
                begun[i] = len(added[i])  # matched as text, before the byte-level split
                continue
            try:
                raw = bytes(alphabet[c] for c in entry)
            except KeyError:  # not a byte-level vocabulary after all
                return None
            begun[i] = sum(1 for b in raw if b & 0xC0 != 0x80)
            inside[i] = int(bool(raw) and raw[0] & 0xC0 == 0x80)
        return cls(tokenizer, begun, inside, (config.get("normalizer") or {}).get("type") == "NFC")

    def encode(self, text: str, base: int) -> tuple[list[int], array] | None:
        """``text``'s ids and where each token starts (character offsets plus ``base``, ``array("I")``),
        or None when this text needs the library's offsets."""
        ascii = text.isascii()
        if self._nfc and not ascii and not unicodedata.is_normalized("NFC", text):
            return None
        ids: list[int] = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        begun = array("I", accumulate(map(self._begun.__getitem__, ids), initial=base))
        if begun[-1] != base + len(text):  # e.g. an added token that took the whitespace beside it
            return None
        if ascii:  # no token begins inside a character
            del begun[-1]
            return ids, begun
        return ids, array("I", map(operator.sub, begun, map(self._inside.__getitem__, ids)))

    def length(self, token: int) -> int:
        """Characters an added token spans (its text)."""
        return self._begun[token]


def added_positions(ids: list[int], added: frozenset[int]) -> list[int]:
    """Indices of ``ids`` that are in ``added``, ascending: a scan in C per added id present (a
    turn holds a few of them among thousands of ids)."""
    found: list[int] = []
    for token in added.intersection(ids):
        at = ids.index(token)
        while True:
            found.append(at)
            try:
                at = ids.index(token, at + 1)
            except ValueError:
                break
    found.sort()
    return found
