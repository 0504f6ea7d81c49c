"""The decision that seats a session: where it may go, and whose room it takes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Seat:
    """A new (or returning) session's seat, as admission grants it."""

    #: ``room`` (within a budget as it stood), ``released`` (once sessions judged ended give up
    #: theirs) or ``rotated`` (once quiet residents were parked for it).
    decision: str
    #: The ranks it may go to (the router picks among them).
    allowed: frozenset[str]
    #: Per allowed rank, the sessions judged ended that release their seats if it goes there.
    victims: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: The sessions parked for it, and on which rank (``rotated``).
    parked_rank: str | None = None
    parked: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        if self.decision == "rotated":
            return (
                f"{len(self.parked)} quiet session(s) parked on {self.parked_rank} after the rotation bound"
            )
        if self.decision == "released":
            return "room once sessions quiet past their think times give up their seats"
        return "room within the budget"
