"""An edited message re-encoded by a Hugging Face tokenizer from a cut inside it
(``tokenization/hf_splice.py``): which tokenizers may, and for those, a returning turn's ids and parts
equal a whole encode's."""

from __future__ import annotations

import json
import random
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests.tokenization.conftest import CHAT_TEMPLATE, TRAINING_TEXT
from tests.tokenization.test_edited import HEAD, PIECE_TEXTS, TEXT
from tests.vllm.build_model import SPECIALS
from tokenization.base import ChatPrompt, common_prefix_len
from tokenization.edited import fresh_start
from tokenization.hf_splice import CL100K_PATTERN, QWEN2_PATTERN, splices
from tokenization.hf_tokenizer import HfTokenizer

BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def split_then_bytes(pattern: str) -> dict[str, Any]:
    return {
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            {**BYTE_LEVEL, "use_regex": False},
        ],
    }


def config(
    pre: Any = BYTE_LEVEL, normalizer: Any = None, model: str = "BPE", added: str = "<|im_end|>"
) -> dict:
    return {
        "normalizer": normalizer,
        "pre_tokenizer": pre,
        "model": {"type": model},
        "added_tokens": [{"content": added, "special": True}],
    }


def test_which_tokenizers_splice() -> None:
    assert splices(config())  # GPT-2's byte-level pattern
    assert splices(config(split_then_bytes(CL100K_PATTERN)))  # Llama 3
    assert splices(config(split_then_bytes(QWEN2_PATTERN), {"type": "NFC"}))  # Qwen2
    refused = [
        config(model="WordPiece"),
        config(normalizer={"type": "Lowercase"}),
        config({"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"}),  # SentencePiece
        config({**BYTE_LEVEL, "add_prefix_space": True}),
        config(split_then_bytes(r"\w+|\s+")),
        config({**split_then_bytes(CL100K_PATTERN), "pretokenizers": [BYTE_LEVEL]}),
        config(added="<|fim prefix|>"),  # "m p": a cut inside an added token
        config(added="ab.c"),
    ]
    assert not any(splices(c) for c in refused)


#: Trained on the tests' text pieces (``test_edited.PIECE_TEXTS``), so that merges join them across
#: every boundary a wrong cut would split (a vocabulary that merges nothing would make any cut look
#: exact).
def _corpus() -> list[str]:
    rng = random.Random(7)
    return ["".join(rng.choice(PIECE_TEXTS) for _ in range(30)) for _ in range(3000)]


def _trained(pre: Any, normalizer: Any = None) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 20 + _corpus(), trainer=trainer)
    return tokenizer


@cache
def tokenizer(kind: str) -> HfTokenizer:
    """A tiny model directory of each accepted kind of pre-tokenizer, with the tests' template."""
    if kind == "gpt2":
        trained = _trained(pre_tokenizers.ByteLevel(add_prefix_space=False))
    else:
        pattern = CL100K_PATTERN if kind == "cl100k" else QWEN2_PATTERN
        split = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
        pre = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        trained = _trained(pre, normalizers.NFC() if kind == "qwen2" else None)
    path = Path(tempfile.mkdtemp(prefix=f"hf-splice-{kind}-"))
    trained.save(str(path / "tokenizer.json"))
    template = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(template), encoding="utf-8")
    tok = HfTokenizer(path)
    assert tok.splices, kind
    tok.min_edit_kept = 1  # splice at any length
    return tok


def turn(content: str, extra: list[dict[str, Any]] | None = None) -> ChatPrompt:
    messages = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Read the file."},
        {"role": "assistant", "content": "Reading it."},
        {"role": "user", "content": content},
        *(extra or []),
    ]
    return ChatPrompt(messages, None)


@pytest.mark.parametrize("kind", ["gpt2", "cl100k", "qwen2"])
@settings(max_examples=150, deadline=None)
@given(lead=TEXT, old_tail=TEXT, new_tail=TEXT, appended=st.booleans())
def test_an_edited_message_spliced_equals_a_whole_encode(
    kind: str, lead: str, old_tail: str, new_tail: str, appended: bool
) -> None:
    tok = tokenizer(kind)
    previous = tok.encode_chat(turn(HEAD + lead + old_tail))
    extra = (
        [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
        if appended
        else None
    )
    prompt = turn(HEAD + lead + new_tail, extra)
    got, whole = tok.encode_chat(prompt, previous), tok.encode_chat(prompt)
    assert list(got.tokens) == list(whole.tokens)
    assert got.parts == whole.parts


@pytest.mark.parametrize("kind", ["gpt2", "cl100k", "qwen2"])
def test_code_edited_near_its_end_is_encoded_from_near_its_end(kind: str) -> None:
    tok = tokenizer(kind)
    source = Path(__file__).read_text(encoding="utf-8") * 2
    previous = tok.encode_chat(turn(source + "\n<system-reminder>\nKeep going.\n</system-reminder>\n"))
    prompt = turn(source)  # the reminder dropped, as agents do to their last message
    encoded: list[str] = []
    inner = tok._encode_piece

    def counting(piece: str, base: int) -> Any:
        encoded.append(piece)
        return inner(piece, base)

    tok._encode_piece = counting  # type: ignore[method-assign]
    try:
        got = tok.encode_chat(prompt, previous)
    finally:
        del tok._encode_piece
    assert list(got.tokens) == list(tok.encode_chat(prompt).tokens)
    assert len(encoded) == 1 and len(encoded[0]) < 600  # from a cut near the edit, not the message's start


@pytest.mark.parametrize("kind", ["gpt2", "cl100k", "qwen2"])
@settings(max_examples=200, deadline=None)
@given(lead=TEXT, old_tail=TEXT, new_tail=TEXT)
def test_every_cut_the_rule_allows_splices_exactly(
    kind: str, lead: str, old_tail: str, new_tail: str
) -> None:
    # Not only the cut the tokenizer would take (the last): every position fresh_start accepts inside
    # the common prefix where an old token starts.
    tok = tokenizer(kind)
    old, new = lead + old_tail, lead + new_tail
    encoded = tok._encode(old, False)
    old_ids, starts = encoded.ids, [start for start, _ in encoded.offsets]
    whole = tok.encode_text(new)
    for c in range(1, common_prefix_len(old, new)):
        if fresh_start(new, c) and c in starts:
            kept = starts.index(c)
            assert old_ids[:kept] + tok.encode_text(new[c:]) == whole, (c, new)
