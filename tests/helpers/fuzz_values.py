"""Hypothesis strategies shared by the fuzz suites: any JSON value, wrong types included."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st


def json_values(text_size: int, items: int, leaves: int) -> st.SearchStrategy[Any]:
    """Any JSON value: scalars of every type (64-bit integers, finite floats, text up to
    ``text_size``) nested in lists and objects of up to ``items`` entries, ``leaves`` scalars in all."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**63 - 1)
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=text_size)
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=items)
            | st.dictionaries(st.text(max_size=2 * items), inner, max_size=items)
        ),
        max_leaves=leaves,
    )
