"""``common_prefix_len``: the chunked/bisected compare equals a plain element-by-element scan."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from tokenization.base import common_prefix_len


def _scan(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


pairs = st.lists(st.integers(0, 3), max_size=600).flatmap(
    lambda a: st.tuples(
        st.just(a),
        st.builds(
            lambda cut, tail: a[:cut] + tail,
            st.integers(0, len(a)),
            st.lists(st.integers(0, 3), max_size=40),
        ),
    )
)


@given(pairs, st.sampled_from([1, 7, 64, 4096]))
def test_equals_scan_for_every_sequence_type(pair: tuple[list[int], list[int]], chunk: int) -> None:
    a, b = pair
    expected = _scan(a, b)
    assert common_prefix_len(a, b, chunk) == expected
    assert common_prefix_len(tuple(a), tuple(b), chunk) == expected
    assert common_prefix_len(array("I", a), array("I", b), chunk) == expected
    assert common_prefix_len("".join(map(str, a)), "".join(map(str, b)), chunk) == expected


@given(pairs)
def test_mixed_types_compare_by_value(pair: tuple[list[int], list[int]]) -> None:
    # A tuple slice never equals a list slice, nor an array slice a list slice: the function must
    # still compare the values.
    a, b = pair
    expected = _scan(a, b)
    assert common_prefix_len(tuple(a), b) == expected
    assert common_prefix_len(array("I", a), b) == expected
    assert common_prefix_len(a, array("I", b)) == expected


def test_values_outside_the_array_type_fall_back_to_lists() -> None:
    assert common_prefix_len(array("I", [1, 2, 3]), [1, 2, -1]) == 2
