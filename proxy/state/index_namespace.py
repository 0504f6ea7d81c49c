"""The shared prefix index's namespace: fixed by ``--index-namespace``, or agreed by the replicas.

Agreed through the state backend (``StateBackend.agree_index_namespace``: on Redis, first writer
wins, ``proxy.state.redis.index_namespace``), proposing the model the ranks serve. A replica that starts
before any rank is up has no model to propose: it uses the namespace agreed before, if any, else
``PROVISIONAL`` until a rank's facts name the model (``routing.rank_facts``), then proposes it and
moves its index to whatever was agreed. Which replica started first, or which rank it could ask
then, decides nothing: every replica ends on the one namespace. A process alone (``memory``
state) has nobody to agree with and no namespace to keep.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.state.backends import StateBackend
from routing.rank_facts import RankFacts
from routing.ranks import Rank

log = logging.getLogger("prefixgate")

#: The namespace of a replica that knows no model yet and finds none agreed.
PROVISIONAL = "default"


class IndexNamespace:
    """The namespace in use (``current``) and whether it is settled (configured or agreed)."""

    def __init__(self, configured: str | None, state: StateBackend) -> None:
        self.configured = configured
        self.state = state
        self.shared = state.name != "memory"
        self.current = configured or PROVISIONAL
        self.settled = configured is not None or not self.shared

    async def first(self, model: str | None) -> str:
        """The namespace to open the index with, ``model`` being what the ranks up now serve."""
        if self.configured is not None:
            log.info("prefix index namespace %s, as configured (--index-namespace)", self.configured)
            return self.configured
        if not self.shared:
            return model or PROVISIONAL
        agreed = await asyncio.to_thread(self.state.agree_index_namespace, model)
        if agreed is None:
            log.info(
                "prefix index namespace %s for now: no rank is up to name the model and no replica "
                "agreed one before; it is agreed once a rank is up",
                PROVISIONAL,
            )
            return PROVISIONAL
        self._settle(agreed, model)
        return agreed

    async def learned(self, rank: Rank, facts: RankFacts) -> None:
        """Propose the model of a rank that came up, if no namespace is agreed yet."""
        if self.settled or not facts.model:
            return
        agreed = await asyncio.to_thread(self.state.agree_index_namespace, facts.model)
        if agreed is None or self.settled:
            return
        moved = agreed != self.current
        self._settle(agreed, facts.model)
        if moved:
            self.state.move_index(agreed)

    def missing(self, rank: Rank) -> list[str]:
        return [] if self.settled else ["index namespace"]

    def _settle(self, agreed: str, proposed: str | None) -> None:
        self.current, self.settled = agreed, True
        if proposed is not None and agreed != proposed:
            log.info(
                "prefix index namespace %s, agreed by another replica first (the ranks here serve %s)",
                agreed,
                proposed,
            )
        else:
            log.info("prefix index namespace %s, agreed through the shared state", agreed)
