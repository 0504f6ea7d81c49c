"""Pinned requests: a Responses request continuing a stored answer (``previous_response_id``), and a
retrieval of one, must reach the rank that stored it, never another.

``Pins`` finds that rank (the response map, ``proxy.state.responses``; for ids stored before this
process knew them, by asking the healthy ranks) and, told by the pipeline's ending, remembers
the rank of every answer a rank stored.

With client keys configured, an answer belongs to the client that had it stored: the map keeps it
under that client's namespace (``proxy.tenants``), so another client asking for the same id finds
nothing (404), and ids the map does not hold are not looked for on the ranks (that would hand any
client's answer to whoever knows its id).
"""

from __future__ import annotations

from urllib.parse import quote

import aiohttp

from proxy.context import Outcome
from proxy.errors import ProxyError
from proxy.state.local import SessionLocals
from proxy.state.responses import ResponseRanks
from proxy.tenants import tenant_key
from routing.ranks import Fleet, Rank

RESPONSES_PATH = "/v1/responses"


def rank_unavailable(response_id: str, rank: str, why: str) -> ProxyError:
    return ProxyError(
        503,
        f"response {response_id!r} is stored on rank {rank}, which is {why}; it cannot be continued "
        "or retrieved on another rank (start a new conversation, or resend the full input without "
        "previous_response_id)",
        type_="service_unavailable",
        code="response_rank_unavailable",
        param="previous_response_id",
    )


def response_not_found(response_id: str) -> ProxyError:
    return ProxyError(
        404,
        f"response {response_id!r} is not known to prefixgate and no healthy rank holds it",
        code="response_not_found",
        param="previous_response_id",
    )


class Pins:
    """Stored answer id -> the rank that stored it."""

    def __init__(
        self,
        ranks: ResponseRanks,
        fleet: Fleet,
        client: aiohttp.ClientSession,
        locals_: SessionLocals,
        probe_timeout: float = 2.0,
    ) -> None:
        self.ranks = ranks
        self.fleet = fleet
        self.client = client
        self.locals = locals_
        self.probe_timeout = probe_timeout

    async def rank_of(self, response_id: str, owner: str | None = None) -> Rank:
        """The healthy rank storing ``owner``'s ``response_id`` (``owner``: the client key's label);
        a 404 or 503 ``ProxyError`` when there is none."""
        key = tenant_key(owner, response_id)
        name = self.ranks.get(key)
        if name is None:
            name = await self._probe(response_id) if owner is None else None
            if name is None:
                raise response_not_found(response_id)
            self.ranks.put(key, name)
        rank = self.fleet.get(name)
        if rank is None:
            raise rank_unavailable(response_id, name, "no longer configured")
        if not rank.healthy:
            raise rank_unavailable(response_id, name, "down")
        return rank

    async def _probe(self, response_id: str) -> str | None:
        """The healthy rank that has ``response_id`` (for ids stored before this process knew them)."""
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
        for rank in self.fleet.healthy():
            url = f"{rank.url}{RESPONSES_PATH}/{quote(response_id, safe='')}"
            try:
                async with self.client.get(url, timeout=timeout) as response:
                    if response.status == 200:
                        return rank.name
            except (aiohttp.ClientError, TimeoutError):
                continue
        return None

    def finished(self, outcome: Outcome) -> None:
        """Remember where an answer was stored (and that its session holds it)."""
        if outcome.stored_id is None or outcome.rank is None:
            return
        key = tenant_key(outcome.ctx.client_label, outcome.stored_id)
        self.ranks.put(key, outcome.rank)
        local = outcome.ctx.local
        if local is not None:
            local.response_ids.append(key)

    def forget(self, response_ids: list[str]) -> None:
        """The session holding these answers (their namespaced ids) ended."""
        for response_id in response_ids:
            self.ranks.forget(response_id)
