"""An edited segment's kept lead: the previous ids up to a safe cut, then only the rest encoded, give
exactly the ids of encoding the whole new text (``tokenization/edited.py``)."""

from __future__ import annotations

import asyncio
from array import array
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.block_hash import make_hasher
from tokenization.edited import kept_lead
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer, chatml_encoding, encode

ENCODING = chatml_encoding()
# What the pre-tokenizer treats apart: letters (accented, CJK), digits, spaces, tabs, CR/LF runs,
# punctuation runs, contractions, special tokens.
PIECE_TEXTS = [
    "a", "Z", "é", "中", "Über", " ", "  ", "\t", "\n", "\r\n", "\n\n", " \n", "'s", "'LL", "12345",
    ".", "...\n", "{", "}", '"', "<|im_end|>", "<|im_start|>", "<|endoftext|>", "<|fim_prefix|>",
    "def ", "x=1", "a_b", "x|y", "<|", "|>", "\u00a0", "🙂", "e\u0301", "-", "#",
]  # fmt: skip
PIECES = st.sampled_from(PIECE_TEXTS)
TEXT = st.lists(PIECES, max_size=40).map("".join)
HEAD = "The previous turn's tool output, kept as it was:\n" + "line of output 42\n" * 12


def _splice(old: str, new: str, pad: tuple[int, ...] = ()) -> tuple[list[int], int, int]:
    """The new text's ids as a splice builds them, with how many old ids and characters it kept."""
    old_ids = array("I", [*pad, *encode(old), *pad])
    start, end = len(pad), len(old_ids) - len(pad)
    kept, chars = kept_lead(ENCODING, old_ids, start, end, old, new, min_kept=1)
    return [*old_ids[start : start + kept], *encode(new[chars:])], kept, chars


@settings(max_examples=400, deadline=None)
@given(lead=TEXT, old_tail=TEXT, new_tail=TEXT, pad=st.sampled_from([(), (7, 8, 9)]))
def test_a_splice_equals_a_whole_encode(lead: str, old_tail: str, new_tail: str, pad: tuple[int, ...]):
    old, new = HEAD + lead + old_tail, HEAD + lead + new_tail
    ids, kept, chars = _splice(old, new, pad)
    assert ids == encode(new)
    assert kept > 0 and chars > 0  # HEAD's line starts are cuts, and the old tail is shorter


@settings(max_examples=300, deadline=None)
@given(old=TEXT, new=TEXT)
def test_any_two_texts_splice_exactly_or_not_at_all(old: str, new: str):
    ids, kept, chars = _splice(old, new)
    assert ids == encode(new)
    assert (kept == 0) == (chars == 0)


def test_code_edited_near_its_end_keeps_its_lead():
    source = Path(__file__).read_text() * 3
    for new in (source[:-400] + "    return None\n", source + "\nAdded line\n", source[:-1]):
        ids, kept, chars = _splice(source, new)
        assert ids == encode(new)
        assert chars > len(source) // 2 and kept > 0


def test_an_edited_message_is_encoded_from_its_kept_lead_only():
    """Through the tokenizer: the turn's ids and block hashes are a whole encode's, and only the
    edited message's end was encoded."""
    source = Path(__file__).read_text() * 2
    tokenizer = TiktokenTokenizer(shared_cache_bytes=0)
    encoded_chars: list[int] = []
    encode_into = tokenizer._encode_into

    def counting(tokens: array, text: str) -> None:
        encoded_chars.append(len(text))
        encode_into(tokens, text)

    tokenizer._encode_into = counting  # type: ignore[method-assign]

    def body(tool_output: str) -> dict:
        return {
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Read the file."},
                {"role": "tool", "content": tool_output},
            ]
        }

    async def scenario() -> None:
        incremental = IncrementalTokenizer(tokenizer, make_hasher("xxh3", 16, "0"), offload_tokens=10**9)
        await incremental.blocks_for_chat("s", body(source))
        encoded_chars.clear()
        edited = source[:-300] + "<system-reminder>trimmed</system-reminder>\n"
        got = await incremental.blocks_for_chat("s", body(edited))
        scratch = IncrementalTokenizer(TiktokenTokenizer(shared_cache_bytes=0), make_hasher("xxh3", 16, "0"))
        want = await scratch.blocks_for_chat(None, body(edited))
        assert list(got.tokens) == list(want.tokens)
        assert list(got.block_hashes) == list(want.block_hashes)
        assert got.parts == want.parts
        assert sum(encoded_chars) < 2000 < len(edited)  # the tail from the cut, not the whole message

    asyncio.run(scenario())
