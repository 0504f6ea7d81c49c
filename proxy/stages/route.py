"""Stage 6, route: where a request goes. The healthy ranks ranked over the prefix index's view, or,
for a pinned request, the one rank that may answer it.

For each request the router looks up (one index access) how many leading blocks of the prompt each
rank probably holds and which rank the session used, lets the policy rank the candidates, and
returns a ``RoutePlan``: the ranks in the order forwarding tries them. The first is charged at once
(its queued prefill and in-flight prompt tokens, the prompt's blocks recorded on it, the session's
rank), so a burst of sibling requests lands together; when a retry lands elsewhere, ``placed``
moves the charge. A streamed answer's queued prefill is released at its first token (``prefilled``:
vLLM sends its first chunk after the prefill); its prompt tokens, whose KV the rank holds while
decoding, and a whole answer's charge are released when it ends. After the answer, ``finished``
releases the rest of the charge, compares the predicted hit with what the rank reported and
corrects the rank's mirror. Ranks whose mirror is fed by KV-cache events (``exact``) get no
speculative records or corrections: their events are the truth. Until a request's events arrive,
its blocks count as in flight on its rank (``routing.index.inflight``).

Pinned requests: a Responses request continuing a stored answer (``previous_response_id``), and a
retrieval of one, must reach the rank that stored it, never another. The plan of a continuation is
that rank, or an error when that rank is gone. ``Pins`` finds that rank (the response map,
``proxy.state.responses``; for ids stored before this process knew them, by asking the healthy
ranks) and, told by the pipeline's ending, remembers the rank of every answer a rank stored.

With client keys configured, an answer belongs to the client that had it stored: the map keeps it
under that client's namespace (``proxy.tenants``), so another client asking for the same id finds
nothing (404), and ids the map does not hold are not looked for on the ranks (that would hand any
client's answer to whoever knows its id).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import quote

import aiohttp

from proxy.context import Admitted, Outcome, RequestContext, RoutePlan
from proxy.errors import ProxyError
from proxy.ops.metrics import Metrics
from proxy.state.local import SessionLocals
from proxy.state.responses import ResponseRanks
from proxy.tenants import tenant_key
from proxy.unavailable import no_rank
from routing.index import Lookup, PrefixIndex
from routing.index.inflight import InFlightBlocks
from routing.index.memory import MemoryPrefixIndex
from routing.policies import RouteRequest, RoutingPolicy
from routing.policies.bounds import max_hit_blocks, prompt_size
from routing.policies.protocol import PrefillSpeeds
from routing.ranks import Fleet, Rank
from tokenization.block_hash import DEFAULT_BLOCK_SIZE

log = logging.getLogger("prefixgate.route")

#: Bound of a rank's speculative mirror when its pool size is unknown (no ``vllm:cache_config_info``,
#: no ``pool_tokens``): without one, routing's own records grow the index forever (~200 B per block).
#: 131,072 blocks = 2M tokens at block size 16 (~26 MB of mirror), the size of a large GPU pool.
UNKNOWN_POOL_BLOCKS = 131_072


#: Before any rank is measured (or without a source): every rank's token weighs the same.
_UNMEASURED: Mapping[str, float] = {}


class Router:
    """Ranks the candidates per request and keeps the prefix index in step with what was routed."""

    def __init__(
        self,
        fleet: Fleet,
        policy: RoutingPolicy,
        index: PrefixIndex | None = None,
        *,
        block_size: int | None = None,
        metrics: Metrics | None = None,
        exact: Iterable[str] = (),
        pins: Pins | None = None,
        speeds: PrefillSpeeds | None = None,
    ) -> None:
        """``speeds``: the ranks' measured prefill speeds, which weigh the prefill queued on each
        (None: queued tokens weigh alike on every rank)."""
        self.fleet = fleet
        self.policy = policy
        self.index: PrefixIndex = index if index is not None else MemoryPrefixIndex()
        self.block_size = block_size or next(
            (r.block_size for r in fleet if r.block_size), DEFAULT_BLOCK_SIZE
        )
        self.metrics = metrics
        self.exact = set(exact)
        self.pins = pins
        self.speeds = speeds
        #: Prefill tokens routed to each rank and not prefilled yet (a stream's first token, or the
        #: end of a whole answer).
        self.queued_prefill: dict[str, int] = {r.name: 0 for r in fleet}
        #: Prompt tokens routed to each rank and not answered yet (KV its running requests hold).
        self.inflight_tokens: dict[str, int] = {r.name: 0 for r in fleet}
        #: Blocks routed to the exact ranks whose KV events have not come yet.
        self.inflight_blocks = InFlightBlocks()
        for rank in fleet:
            self.index.set_capacity(rank.name, self.capacity_blocks(rank))

    def capacity_blocks(self, rank: Rank) -> int | None:
        """The rank's pool in blocks; ``UNKNOWN_POOL_BLOCKS`` for an unknown pool; None (unbounded)
        for a mirror driven by KV-cache events, which remove what the rank evicts."""
        if rank.name in self.exact:
            return None
        if not rank.pool_tokens:
            return UNKNOWN_POOL_BLOCKS
        return rank.pool_tokens // self.block_size

    def set_exact(self, rank: str, exact: bool = True) -> None:
        """Mark ``rank``'s mirror as driven by KV-cache events (or not)."""
        if exact:
            self.exact.add(rank)
        else:
            self.exact.discard(rank)
        found = self.fleet.get(rank)
        if found is not None:
            self.index.set_capacity(rank, self.capacity_blocks(found))

    # -- stage 6 ----------------------------------------------------------------------------------

    async def __call__(self, ctx: RequestContext) -> RoutePlan:
        """The plan for ``ctx``: pinned to a stored answer's rank, else ranked by the policy."""
        stored = ctx.api.continues(ctx.body)
        if stored is not None and self.pins is not None:
            rank = await self.pins.rank_of(stored, ctx.client_label)  # only the client's own answers
            plan = RoutePlan([rank])
            self._charge(ctx, plan, rank, Lookup())
            return plan
        return self.plan(ctx)

    def plan(self, ctx: RequestContext) -> RoutePlan:
        """Rank the healthy ranks ``ctx`` may go to (admission may restrict a new session's)."""
        candidates = self.fleet.healthy()
        admitted = ctx.admitted
        allowed = admitted.allowed if admitted is not None else None
        if allowed is not None:  # admission: a new session only goes to a rank with room
            candidates = [r for r in candidates if r.name in allowed]
        if not candidates:
            raise no_rank(self.fleet, ctx.session_key and f"session {ctx.session_key}", allowed)
        hashes = ctx.block_hashes
        key = ctx.session_key
        answered = ctx.cached_answer
        if answered is not None and answered.credited and answered.rank not in self.exact:
            # the blocks of the previous answer, which the rank cached while decoding it
            self.index.record(answered.rank, hashes[: answered.blocks])
        found = self._lookup(hashes, key)
        blocks = ctx.prompt_blocks
        speeds = self.speeds
        request = RouteRequest(
            key,
            ctx.prompt_tokens,
            hashes,
            found.matches,
            found.session_rank,
            self.block_size,
            self.queued_prefill,
            admitted.home if admitted is not None else None,
            self.inflight_tokens,
            blocks.head()[1] if blocks is not None else 0,
            speeds.measured() if speeds is not None else _UNMEASURED,
            found.offloaded,
            speeds.cpu_load_costs() if speeds is not None else _UNMEASURED,
        )
        plan = RoutePlan(self.policy.order(request, candidates))
        bound = self._bind(key, plan, found) if key else False
        self._charge(ctx, plan, plan.ranks[0], found, bound=bound)
        return plan

    def _bind(self, key: str, plan: RoutePlan, found: Lookup) -> bool:
        """Bind the session to the plan's first rank, first writer wins across replicas: when
        another replica bound it elsewhere since the lookup, that rank goes first (the loser
        adopts the winner's). False when the winner's rank is not a candidate here (down, or no
        room per admission): the session then moves, as for a failed rank."""
        chosen = plan.ranks[0].name
        if found.session_rank == chosen:
            return True
        winner = self.index.bind_session(key, chosen, found.session_rank)
        if winner == chosen:
            return True
        adopted = next((r for r in plan.ranks if r.name == winner), None)
        if adopted is None:
            return False
        log.info("session %s: another replica bound it to %s first; adopted (not %s)", key, winner, chosen)
        plan.ranks.remove(adopted)
        plan.ranks.insert(0, adopted)
        found.session_rank = winner
        return True

    def any(self) -> RoutePlan:
        """A plan for a request that caches nothing (token counting, ``/tokenize``): the healthy
        ranks in the policy's order for a request it knows nothing about; nothing is charged."""
        candidates = self.fleet.healthy()
        if not candidates:
            raise no_rank(self.fleet, "a request for any rank")
        return RoutePlan(self.policy.order(RouteRequest(block_size=self.block_size), candidates))

    def holds(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """The leading blocks of a prompt each rank holds or has in flight (a read, for admission)."""
        return self._lookup(block_hashes, None).matches

    def queued(self, rank: str) -> int:
        """Prefill tokens this process routed to ``rank`` and not prefilled yet (a read, for
        admission)."""
        return self.queued_prefill.get(rank, 0)

    def placed(self, ctx: RequestContext, rank: Rank) -> None:
        """Forwarding reached ``rank``: when a retry landed away from the charged rank, move the
        charge (and the session, and the blocks' record) there."""
        plan = ctx.plan
        if plan is None or plan.charged == rank.name:
            return
        previous = plan.charged
        self._release(plan)
        found = self._lookup(ctx.block_hashes, None)
        found.session_rank = previous
        self._charge(ctx, plan, rank, found, "its rank failed this request")

    def landed(self, ctx: RequestContext) -> None:
        """A turn routed on its head (or on the blocks it kept) landed: its charge becomes the whole
        prompt's, as routing it whole would have made it (its previous answer's blocks in the
        expected hit, the whole prompt's prefill and tokens), and the charged rank holds the whole
        prompt once answering."""
        plan = ctx.plan
        name = plan.charged if plan is not None else None
        hashes = ctx.block_hashes
        if plan is None or name is None or not hashes:
            return
        answered = ctx.cached_answer
        if answered is not None and answered.credited and answered.rank not in self.exact:
            self.index.record(answered.rank, hashes[: answered.blocks])
        estimate = ctx.estimated_cached_tokens or 0
        if name not in self.exact and estimate >= plan.blocks * self.block_size:
            # Every block it was routed on is a hit: and the rest? Not on a rank fed by KV events,
            # whose events of this very prompt would count as hits (nothing here recorded it yet).
            held = self.index.match(hashes).get(name, 0)
            estimate = ctx.estimated_cached_tokens = self._hit_tokens(ctx, held)
        prompt = prompt_size(ctx.prompt_tokens, len(hashes), self.block_size)
        prefill = max(prompt - estimate, 0)
        if name in self.exact:  # the rest of the prompt is on its way there too
            rest = self.inflight_blocks.add(name, hashes[plan.blocks :])
            if plan.prefilled:
                self.inflight_blocks.prefilled(name, rest)
            else:
                plan.inflight_blocks.append(rest)
        if not plan.prefilled:
            self.queued_prefill[name] = max(self.queued_prefill.get(name, 0) + prefill - plan.prefill, 0)
        self.inflight_tokens[name] = max(self.inflight_tokens.get(name, 0) + prompt - plan.tokens, 0)
        plan.prefill, plan.tokens = prefill, prompt
        if name not in self.exact:
            self.index.record(name, hashes)

    def prefilled(self, ctx: RequestContext) -> None:
        """A streamed answer's first token, or the end of a request whose prompt is still landing:
        the rank's prefill is done, so its tokens leave the rank's queued prefill now (once per
        charge), not when a decode of minutes ends or our tokenizer catches up (the prompt's KV stays
        in flight)."""
        if ctx.plan is not None:
            self._unqueue(ctx.plan)

    def finished(self, outcome: Outcome) -> None:
        """After the answer (or the failure): release the charge; count predicted vs reported hit
        tokens and, when the rank hit fewer tokens than predicted, drop the blocks past the actual
        hit from its mirror."""
        ctx = outcome.ctx
        if ctx.plan is not None:
            self._release(ctx.plan)
        usage = outcome.usage
        predicted = ctx.estimated_cached_tokens
        rank = outcome.rank
        if rank is None or usage is None or predicted is None or usage.cached_tokens is None:
            return
        cached = usage.cached_tokens
        metrics = self.metrics
        if metrics is not None:
            metrics.series(metrics.predicted_cached_tokens, rank).inc(predicted)
            metrics.series(metrics.reported_cached_tokens, rank).inc(cached)
        if rank in self.exact or cached >= predicted:
            return
        if metrics is not None:
            metrics.series(metrics.index_corrections, rank).inc()
        answered = ctx.cached_answer
        if answered is not None and answered.credited and answered.rank == rank:
            # The agent sent its previous answer back rewritten (its thread stops counting such
            # answers): what was missing was the answer's blocks, and the rank holds this prompt now.
            return
        self.index.remove(rank, ctx.block_hashes[cached // self.block_size :])

    def _lookup(self, hashes: Sequence[bytes], key: str | None) -> Lookup:
        """The index's view of ``hashes`` and ``key``, with the blocks in flight to each rank after it."""
        found = self.index.lookup(hashes, key) if hashes or key else Lookup()
        self.inflight_blocks.extend(hashes, found.matches)
        return found

    # -- the charge -------------------------------------------------------------------------------

    def _charge(
        self,
        ctx: RequestContext,
        plan: RoutePlan,
        rank: Rank,
        found: Lookup,
        why: str | None = None,
        *,
        bound: bool = False,
    ) -> None:
        """``rank`` holds ``ctx`` now: its expected hit, its queued prefill and prompt tokens, the
        prompt's blocks and the session's rank (``why``: the reason it left its previous rank;
        ``bound``: the session's binding to ``rank`` is written already)."""
        name = rank.name
        hashes = ctx.block_hashes
        estimate = self._hit_tokens(ctx, found.matches.get(name, 0))
        ctx.estimated_cached_tokens = estimate if hashes else None
        cpu_blocks = found.offloaded_in(name, estimate // self.block_size)
        ctx.estimated_cpu_tokens = cpu_blocks * self.block_size if hashes else None
        prompt = prompt_size(ctx.prompt_tokens, len(hashes), self.block_size)
        plan.charged, plan.prefill, plan.tokens = name, max(prompt - estimate, 0), prompt
        plan.blocks = len(hashes)
        plan.prefilled = False
        if name in self.exact:
            plan.inflight_blocks.append(self.inflight_blocks.add(name, hashes[found.matches.get(name, 0) :]))
        self.queued_prefill[name] = self.queued_prefill.get(name, 0) + plan.prefill
        self.inflight_tokens[name] = self.inflight_tokens.get(name, 0) + prompt
        key = ctx.session_key
        if key and found.session_rank != name:
            if found.session_rank is not None:
                self._moved(ctx, found, found.session_rank, name, plan.prefill, why)
            if not bound:
                self.index.set_session_rank(key, name)
        if hashes and name not in self.exact:
            self.index.record(name, hashes)

    def _hit_tokens(self, ctx: RequestContext, held: int) -> int:
        """The tokens of ``ctx``'s prompt a rank holding ``held`` of its leading blocks serves from
        its cache (vLLM recomputes the prompt's last token)."""
        size = self.block_size
        return min(held, max_hit_blocks(ctx.prompt_tokens, len(ctx.block_hashes), size)) * size

    def _release(self, plan: RoutePlan) -> None:
        name = plan.charged
        if name is None:
            return
        self._unqueue(plan)
        plan.charged = None
        self.inflight_tokens[name] = max(self.inflight_tokens.get(name, 0) - plan.tokens, 0)

    def _unqueue(self, plan: RoutePlan) -> None:
        """Take the plan's prefill off its charged rank's queue, once per charge."""
        name = plan.charged
        if name is None or plan.prefilled:
            return
        plan.prefilled = True
        self.queued_prefill[name] = max(self.queued_prefill.get(name, 0) - plan.prefill, 0)
        for blocks in plan.inflight_blocks:
            self.inflight_blocks.prefilled(name, blocks)
        plan.inflight_blocks.clear()

    def _moved(
        self, ctx: RequestContext, found: Lookup, old: str, new: str, prefill: int, why: str | None
    ) -> None:
        """Count a known session leaving its rank ``old`` by what that rank held of its prompt, and
        say why: each move recomputes its context elsewhere."""
        held = found.matches.get(old, 0)
        # vLLM looks a prompt up in the GPU pool first, then in the CPU tier: a chain's head is on the
        # GPU (a shared system prompt, hot) and what the rank offloaded of the session is its tail.
        tier = "none" if not held else "cpu" if found.offloaded_in(old, held) else "gpu"
        if self.metrics is not None:
            self.metrics.series(self.metrics.session_moves, tier).inc()
        if not log.isEnabledFor(logging.INFO):
            return
        admitted = ctx.admitted
        reason = why or _move_reason(
            admitted, self.fleet.healthy(), old, new, prefill, self.queued_prefill, self.inflight_tokens
        )
        session = admitted.session if admitted is not None else None
        turns = session.turns if session is not None else 0  # admission counts this request already
        log.info(
            "session %s turn %d moved %s -> %s: %s (%s held %d leading blocks of it, %s)",
            ctx.session_key,
            turns - 1,
            old,
            new,
            reason,
            old,
            held,
            tier,
        )

    def stats(self) -> dict[str, object]:
        """The index's stats and the prefill queued per rank."""
        return {"index": self.index.stats(), "queued_prefill": dict(self.queued_prefill)}


def _move_reason(
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


# -- pinned requests ------------------------------------------------------------------------------

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
