"""Why a known session left its rank, in words for the log (each move recomputes its context)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from routing.ranks import Rank

if TYPE_CHECKING:
    from proxy.context import Admitted


def move_reason(
    admitted: Admitted | None,
    candidates: Sequence[Rank],
    old: str,
    new: str,
    prefill: int,
    queued: Mapping[str, int],
    inflight_tokens: Mapping[str, int],
) -> str:
    """The reason routing gives when a session went from ``old`` to ``new`` on its own account
    (``prefill``: this request's on ``new``; ``queued``: prefill queued per rank, this request's
    included; ``inflight_tokens``: prompt tokens in flight per rank)."""
    if admitted is not None and admitted.allowed is not None:
        room = ", ".join(sorted(admitted.allowed))
        return f"admitted anew (back after idling out or being released), room on {room}"
    if all(r.name != old for r in candidates):
        return "its rank is down or failed this request"
    home = admitted.home if admitted is not None else None
    return (
        f"{'saturated' if home == old else 'over the load bound'} (in flight "
        f"{', '.join(f'{r.name}={r.in_flight}' for r in candidates)}; prompt tokens in flight "
        f"on {old} {inflight_tokens.get(old, 0)}; prefill queued on {old} "
        f"{queued.get(old, 0)}, on {new} {queued.get(new, 0) - prefill}; "
        f"this request's there {prefill})"
    )
