"""Token starts computed from a byte-level BPE encoding's ids (``tokenization/hf_starts.py``) equal
the library's offsets, and a turn built with them equals one built with the library's."""

from __future__ import annotations

import json
import random
import unicodedata
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, pre_tokenizers, processors

from tests.tokenization.test_edited import TEXT
from tests.tokenization.test_hf_splice import _trained, tokenizer, turn
from tokenization.hf_starts import StartTable, added_positions
from tokenization.hf_tokenizer import HfTokenizer

KINDS = ["gpt2", "cl100k", "qwen2"]


def config(tok: Tokenizer) -> dict[str, Any]:
    return json.loads(tok.to_str())


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=300, deadline=None)
@given(text=TEXT, base=st.integers(0, 1000))
def test_computed_starts_equal_the_library_offsets(kind: str, text: str, base: int) -> None:
    tok = tokenizer(kind)
    assert tok.starts is not None
    encoding = tok._encode(text, False)
    computed = tok.starts.encode(text, base)
    if kind == "qwen2" and not unicodedata.is_normalized("NFC", text):
        assert computed is None  # its normalizer would move characters: the library's offsets
        return
    assert computed is not None
    ids, starts = computed
    assert ids == encoding.ids
    assert list(starts) == [base + start for start, _ in encoding.offsets]


def test_the_tiny_model_has_a_table(hf_tokenizer: HfTokenizer) -> None:
    assert hf_tokenizer.starts is not None  # the other HF tests run through it


def test_which_tokenizers_get_a_table() -> None:
    trained = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    base = config(trained)
    assert StartTable.of(trained, base) is not None
    refused = [
        {**base, "model": {**base["model"], "type": "WordPiece"}},
        {**base, "normalizer": {"type": "Lowercase"}},
        {**base, "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}},
        {**base, "pre_tokenizer": {**base["pre_tokenizer"], "add_prefix_space": True}},
    ]
    assert all(StartTable.of(trained, c) is None for c in refused)


def test_offsets_the_library_trims_are_left_to_it() -> None:
    trimmed = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    trimmed.post_processor = processors.ByteLevel(trim_offsets=True)  # " b" starts at "b"
    assert StartTable.build(trimmed, config(trimmed)) is not None
    assert StartTable.of(trimmed, config(trimmed)) is None  # the probe disagrees


def test_an_added_token_that_takes_the_whitespace_beside_it_is_left_to_the_library() -> None:
    stripping = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    stripping.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    assert StartTable.of(stripping, config(stripping)) is None  # the probe spaces every added token
    table = StartTable.build(stripping, config(stripping))
    assert table is not None
    assert table.encode(" a <mask> b", 0) is None  # its characters do not add up
    assert table.encode("a<mask> b", 0) is not None


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 9), max_size=60), added=st.frozensets(st.integers(0, 12)))
def test_added_positions_are_every_index_of_an_added_id(ids: list[int], added: frozenset[int]) -> None:
    assert added_positions(ids, added) == [i for i, token in enumerate(ids) if token in added]


@pytest.mark.parametrize("kind", KINDS)
def test_turns_built_on_computed_starts_equal_turns_built_on_the_library_offsets(kind: str) -> None:
    computed = tokenizer(kind)
    table = computed.starts
    rng = random.Random(kind)
    pieces = ["line 42\n", "caf\u00e9 \u2192 \U0001f600 ", "\u53f8\u9a6c", "def f(x):\n", " ", "\n\n"]
    contents = ["".join(rng.choice(pieces) for _ in range(rng.randint(5, 60))) for _ in range(6)]
    previous: dict[str, Any] = {"computed": None, "library": None}
    try:
        for i, content in enumerate(contents):
            extra = [{"role": "assistant", "content": c} for c in contents[:i]]
            prompt = turn(content, extra)
            computed.starts = table
            got = computed.encode_chat(prompt, previous["computed"])
            computed.starts = None
            want = computed.encode_chat(prompt, previous["library"])
            assert list(got.tokens) == list(want.tokens)
            assert got.parts == want.parts
            for field in ("starts", "anchors", "anchor_ends"):
                assert list(getattr(got.memo, field)) == list(getattr(want.memo, field)), field
            previous = {"computed": got, "library": want}
    finally:
        computed.starts = table
