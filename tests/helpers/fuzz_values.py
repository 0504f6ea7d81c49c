"""What the fuzz suites share: any JSON value (wrong types included), and their counts' report."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
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


def write_counts(out: Path, name: str, tried: Counter[str], statuses: Counter[str]) -> None:
    """Write the inputs tried (by kind) and the statuses answered to ``out``, and print them."""
    total = sum(tried.values())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"inputs_tried": total, "by_kind": tried, "statuses": statuses}, indent=2))
    print(f"\n{name}: {total} inputs tried {dict(tried)}; statuses {dict(statuses)} -> {out}")
