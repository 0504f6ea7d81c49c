"""hf_parts: a walk resumed from the previous turn's equals the walk from scratch.

The texts come from a toy template and a toy tokenizer, so that what the resumption must get right is
easy to reach: contents that repeat or occur across message boundaries, messages the template does
not render, contents edited to another of the same length, edits anywhere.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization.base import Part, common_prefix_len
from tokenization.hf_parts import NOT_FOUND, Walk, message_parts

#: "<" opens each rendered message and is the only added token.
ANCHOR = "<"
CONTENT = st.text(alphabet="ab<>", max_size=6)
MESSAGE = st.builds(
    lambda role, content: {"role": role, "content": content}, st.sampled_from(["user", "hidden"]), CONTENT
)
EDIT = st.tuples(st.integers(0, 30), CONTENT)


def render(messages: list[dict[str, Any]]) -> str:
    """A template that leaves out ``hidden`` messages."""
    return "".join(f"{ANCHOR}{m['content']}>" for m in messages if m["role"] != "hidden")


def tokenize(text: str) -> tuple[array, array]:
    """Token starts (each run of one character is a token; every "<" is a token alone) and the
    indices of the anchor tokens."""
    starts, anchors = array("I"), array("I")
    for i, ch in enumerate(text):
        if ch == ANCHOR or i == 0 or text[i - 1] != ch or text[i - 1] == ANCHOR:
            if ch == ANCHOR:
                anchors.append(len(starts))
            starts.append(i)
    return starts, anchors


def unchanged_chars(old: str, new: str, starts: array, anchors: array) -> int:
    """Where the HF tokenizer would re-encode from: the start of the last anchor wholly inside the
    texts' common prefix (0: none)."""
    same = common_prefix_len(old, new)
    cut = 0
    for token in anchors:
        if starts[token] + 1 <= same:
            cut = starts[token]
    return cut


def walks(
    first: list[dict[str, Any]], second: list[dict[str, Any]]
) -> tuple[Walk, int, tuple[tuple[Part, ...], Walk], tuple[tuple[Part, ...], Walk]]:
    """The first turn's walk, where the second re-encodes from, and the second turn's parts and walk
    from scratch and resumed from the first's."""
    old_text, new_text = render(first), render(second)
    old_starts, old_anchors = tokenize(old_text)
    _, previous = message_parts(old_text, first, old_starts, old_anchors, len(old_starts))
    starts, anchors = tokenize(new_text)
    unchanged = unchanged_chars(old_text, new_text, old_starts, old_anchors)
    scratch = message_parts(new_text, second, starts, anchors, len(starts))
    resumed = message_parts(new_text, second, starts, anchors, len(starts), previous, unchanged)
    return previous, unchanged, scratch, resumed


@settings(max_examples=400, deadline=None)
@given(
    first=st.lists(MESSAGE, max_size=8),
    edits=st.lists(EDIT, max_size=3),
    appended=st.lists(MESSAGE, max_size=3),
    cut_at=st.integers(0, 10),
)
def test_resumed_walk_equals_walk_from_scratch(
    first: list[dict[str, Any]], edits: list[tuple[int, str]], appended: list[dict[str, Any]], cut_at: int
) -> None:
    second = [dict(m) for m in first[: len(first) - cut_at % (len(first) + 1)] or first]
    for index, content in edits:
        if second:
            second[index % len(second)]["content"] = content
    second += appended
    _, _, scratch, resumed = walks(first, second)
    assert resumed == scratch


def test_a_message_not_found_before_is_searched_again() -> None:
    first = [
        {"role": "user", "content": "ab"},
        {"role": "hidden", "content": "zz"},
        {"role": "user", "content": "b"},
    ]
    second = [*first, {"role": "user", "content": "zz"}]  # the hidden message's content now appears
    previous, _, scratch, resumed = walks(first, second)
    assert previous.found[1] == NOT_FOUND
    assert resumed == scratch
    assert scratch[1].found[1] > 0


@pytest.mark.parametrize(("edited", "found", "searched"), [("ba", NOT_FOUND, 0), ("abc", 1, 4)])
def test_a_message_edited_inside_text_that_did_not_change_is_searched_again(
    edited: str, found: int, searched: int
) -> None:
    # The hidden message's content "ab" is found inside the next message's rendered text, which its
    # edit does not change: only its content tells (another text of its length, "ba"; or grown into
    # text the prompt also holds, "abc").
    first = [
        {"role": "hidden", "content": "ab"},
        {"role": "user", "content": "abcd"},
        {"role": "user", "content": "c"},
    ]
    second = [{"role": "hidden", "content": edited}, *first[1:], {"role": "user", "content": "d"}]
    previous, unchanged, scratch, resumed = walks(first, second)
    assert previous.found[0] == 1 and unchanged >= previous.searched[0]
    assert resumed == scratch
    assert (scratch[1].found[0], scratch[1].searched[0]) == (found, searched)
