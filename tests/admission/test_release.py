"""Admission's two budget refinements, on a fake clock: shared heads counted once per rank, and
sessions idle past their own think times released when (and only when) a new session needs room."""

from __future__ import annotations

import asyncio
import time
from array import array

import httpx
import pytest
from starlette.datastructures import Headers

from proxy.admission import Admission, AdmissionConfig
from proxy.admission.learned import release_after
from proxy.apis import CHAT
from proxy.apis.base import Usage
from proxy.context import Outcome, RequestContext
from proxy.state.memory import MemorySessionStore
from proxy.state.sessions import Session, SessionTable
from routing.ranks import Fleet, Rank
from tests.admission.conftest import KV_TOKENS, chat, prompt_of
from tokenization.prompt import PromptBlocks

BLOCK = 16
POOL = 2000  # budget 1,600 tokens at FRACTION
#: The budget share these tests' arithmetic is written for (not the default, which may move).
FRACTION = 0.8
TTL = 300.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(ranks: int = 1, **config: object) -> tuple[Admission, Clock]:
    clock = Clock()
    table = SessionTable(MemorySessionStore(), TTL, clock)
    pool = Fleet(Rank(f"r{i}", f"http://r{i}", pool_tokens=POOL) for i in range(ranks))
    # a long rotation bound: these tests are about room and release, not rotation (test_rotation.py)
    options: dict[str, object] = {
        "idle_ttl": TTL,
        "wait": 3600.0,
        "block_size": BLOCK,
        "target_fraction": FRACTION,
        **config,
    }
    return Admission(table, pool, AdmissionConfig(**options), None), clock  # type: ignore[arg-type]


def ctx_for(key: str, tokens: int, head: bytes | None = None, head_tokens: int = 0) -> RequestContext:
    ctx = RequestContext(CHAT, Headers(), b"", {}, False, "m", 0.0)
    ctx.session_key = key
    ctx.prompt_tokens = tokens
    if head is not None:
        # the head's blocks end in ``head``; the rest of the prompt is the session's own
        hashes = [b"h%d" % i for i in range(head_tokens // BLOCK - 1)] + [head]
        hashes += [f"{key}{i}".encode() for i in range((tokens - head_tokens) // BLOCK)]
        parts = (("system+tools", 0, head_tokens), ("message[1]", head_tokens, tokens))
        ctx.prompt_blocks = PromptBlocks(tokens, BLOCK, hashes, parts, array("I"), shared_tokens=head_tokens)
        ctx.block_hashes = hashes
    return ctx


async def turn(adm: Admission, key: str, tokens: int, **head: object) -> RequestContext:
    """One request: admitted, routed to the first allowed rank, answered (16 output tokens)."""
    ctx = ctx_for(key, tokens, **head)  # type: ignore[arg-type]
    ctx.admitted = await adm.admit(ctx)
    assert ctx.admitted.session is not None
    rank = sorted(ctx.admitted.allowed)[0] if ctx.admitted.allowed else ctx.admitted.session.rank or "r0"
    placed = adm.fleet.get(rank)
    assert placed is not None
    adm.placed(ctx, placed)
    adm.finished(Outcome(ctx, rank, 200, Usage(tokens, 16, 0)))
    return ctx


async def waits(adm: Admission, key: str, tokens: int) -> None:
    """``key``'s request finds no seat: it waits in the queue (it is never refused for lack of room)."""
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(adm.admit(ctx_for(key, tokens)), 0.2)
    assert len(adm.queue) == 0  # the cancelled waiter left the queue


async def two_idle_sessions() -> tuple[Admission, Clock]:
    """One rank holding sessions ``a`` then ``b`` (two turns, a 1 s think gap each), both idle for 100 s:
    far past 2 x 1 s and the 30 s floor, well within the 300 s TTL."""
    adm, clock = make()
    for key in ("a", "b"):
        await turn(adm, key, 600)
        clock.now += 1
        await turn(adm, key, 700)
    clock.now += 100
    return adm, clock


def test_release_after_follows_the_sessions_own_think_gaps() -> None:
    config = AdmissionConfig(idle_ttl=TTL, target_fraction=FRACTION)
    s = Session("s", created=0.0, last_seen=0.0)
    assert release_after(config, s) == TTL  # no gap seen yet: the full idle TTL
    s.answered_at = 10.0
    s.last_seen = 10.0
    s.note_request(14.0)  # a 4 s think gap
    assert (s.gaps, s.gap_max) == (1, 4.0)
    assert not s.answered  # the request is in flight
    assert release_after(config, s) == 30.0  # 2 x 4 s is under the floor: 0.1 x the TTL
    s.answered_at = s.last_seen = 20.0
    s.note_request(120.0)
    assert release_after(config, s) == 200.0
    s.answered_at = s.last_seen = 130.0
    s.note_request(400.0)
    assert release_after(config, s) == TTL  # never past the idle TTL
    s.note_request(900.0)  # no answer in between: not a think gap
    assert s.gaps == 3


async def test_idle_sessions_keep_their_room_until_a_new_session_needs_it() -> None:
    adm, clock = await two_idle_sessions()
    states = adm.refresh()
    assert [s.key for s, _ in states["r0"].reclaimable] == ["a", "b"]  # longest idle first
    assert states["r0"].sessions == 2  # nobody asked for room: they still count
    small = ctx_for("small", 100)
    small.admitted = await adm.admit(small)  # fits as is: nothing is released
    assert small.admitted.allowed == {"r0"}
    adm.placed(small, adm.fleet.get("r0"))  # type: ignore[arg-type]
    assert {s.key for s in adm.table.active()} == {"a", "b", "small"}

    big = ctx_for("c", 700)
    big.admitted = await adm.admit(big)  # room only once the longest-idle session goes
    assert big.admitted.allowed == {"r0"}
    adm.placed(big, adm.fleet.get("r0"))  # type: ignore[arg-type]
    a = adm.table.get("a")
    assert a is not None and a.released and not a.is_active(clock.now, TTL)
    assert {s.key for s in adm.table.active()} == {"b", "small", "c"}

    # a comes back: a new session again, which has to find room like any other (b's, idle as long)
    back = ctx_for("a", 800)
    back.admitted = await adm.admit(back)
    assert back.admitted.allowed == {"r0"} and adm.reservation("a").victims == {"r0": ("b",)}  # type: ignore[union-attr]
    adm.placed(back, adm.fleet.get("r0"))  # type: ignore[arg-type]
    assert {s.key for s in adm.table.active()} == {"a", "small", "c"}
    a = adm.table.get("a")
    assert a is not None and not a.released and a.turns == 3


async def test_sessions_in_flight_or_within_their_think_times_are_not_released() -> None:
    adm, clock = make()
    await turn(adm, "thinker", 600)
    clock.now += 50
    await turn(adm, "thinker", 700)  # a 50 s gap: released only after 100 s
    await turn(adm, "busy", 600)
    clock.now += 1
    await adm.admit(ctx_for("busy", 700))  # never answered: in flight
    clock.now += 90  # thinker is within 2 x its gap, busy is in flight
    assert adm.refresh()["r0"].reclaimable == []
    await waits(adm, "new", 700)
    clock.now += 20  # thinker is past 100 s now
    new = ctx_for("new", 700)
    new.admitted = await adm.admit(new)
    adm.placed(new, adm.fleet.get("r0"))  # type: ignore[arg-type]
    thinker, busy = adm.table.get("thinker"), adm.table.get("busy")
    assert thinker is not None and thinker.released
    assert busy is not None and not busy.released


async def test_a_victim_back_before_the_pick_is_kept_and_its_own_turns_are_never_refused() -> None:
    adm, _ = await two_idle_sessions()
    new = ctx_for("c", 700)
    new.admitted = await adm.admit(new)  # a is to make room
    again = await turn(adm, "a", 900)  # but a sends its next turn before c is routed
    assert again.admitted.allowed is None  # an active session: admitted at once, whatever its size
    adm.placed(new, adm.fleet.get("r0"))  # type: ignore[arg-type]
    a = adm.table.get("a")
    assert a is not None and not a.released and a.turns == 3


async def test_pending_victims_are_not_claimed_twice() -> None:
    adm, _ = await two_idle_sessions()
    first = ctx_for("c", 700)
    first.admitted = await adm.admit(first)
    second = ctx_for("d", 700)
    second.admitted = await adm.admit(second)  # a is claimed by c's reservation: d needs b
    assert adm.reservation("c").victims == {"r0": ("a",)}  # type: ignore[union-attr]
    assert adm.reservation("d").victims == {"r0": ("b",)}  # type: ignore[union-attr]
    await waits(adm, "e", 700)  # nothing reclaimable is left


async def test_a_shared_head_counts_once_per_rank() -> None:
    adm, _ = make(ranks=2)
    head = {"head": b"claude-code-head", "head_tokens": 640}
    # 1,000 tokens each: two would need 2,000 of a 1,600 budget, but 640 of them are the same blocks
    await turn(adm, "a", 1000, **head)
    second = await turn(adm, "b", 1000, **head)
    assert second.admitted.allowed == {"r0", "r1"}  # an empty rank and one holding the head
    states = adm.refresh()
    assert states["r0"].working_set_tokens == 2 * 1016 - 640
    assert states["r0"].shared_head_tokens == 640
    assert states["r0"].heads == {b"claude-code-head".hex(): 2}
    other = await turn(adm, "x", 1000, head=b"another-head", head_tokens=640)
    assert other.admitted.allowed == {"r1"}  # a different head gets no discount on r0
    session = adm.table.get("a")
    assert session is not None and session.head_tokens == 640


async def test_without_a_head_every_session_counts_in_full() -> None:
    adm, _ = make()
    await turn(adm, "a", 1000)
    await waits(adm, "b", 1000)
    assert adm.refresh()["r0"].working_set_tokens == 1016


# -- end to end: a real proxy in front of one simulated rank with a 2,048-token pool ---------------


def test_shared_system_prompt_counts_once_on_a_real_rank(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, admission_wait=30, session_idle_ttl=60, target_fraction=FRACTION)
    system = {"role": "system", "content": "Follow the house rules. " * 120}  # ~600 tokens, shared

    def ask(session: str) -> httpx.Response:
        body = {
            "model": "sim",
            "messages": [system, {"role": "user", "content": prompt_of(session, 300)}],
            "max_tokens": 16,
        }
        return httpx.post(
            proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": session}, timeout=20
        )

    # ~950 tokens each: two would overflow a 1,638-token budget if each paid for the system prompt
    for session in ("a", "b", "c"):
        assert ask(session).status_code == 200
    rows = httpx.get(proxy.url + "/admin/sessions", params={"active": "1"}, timeout=5).json()["data"]
    assert {r["id"] for r in rows} == {"a", "b", "c"}
    assert sum(r["context_tokens"] for r in rows) > KV_TOKENS * FRACTION
    heads = {r["head_key"] for r in rows}
    assert len(heads) == 1 and None not in heads
    assert all(r["head_tokens"] >= 512 for r in rows)
    with pytest.raises(httpx.TimeoutException):  # the rest still has to fit: d waits for a seat
        httpx.post(
            proxy.url + "/v1/chat/completions",
            json={"model": "sim", "messages": [system, {"role": "user", "content": prompt_of("d", 300)}]},
            headers={"x-session-id": "d"},
            timeout=1.0,
        )


def test_finished_sessions_make_room_before_the_idle_ttl(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    # the rotation bound is far past the 5 s TTL: only a release can seat c soon
    proxy = gateway(ranks, admission_wait=60.0, session_idle_ttl=5.0)
    for session in ("a", "b"):
        assert chat(proxy.url, session, 700).status_code == 200
        assert chat(proxy.url, session, 700).status_code == 200  # a short think gap
    time.sleep(0.6)  # past 0.1 x the TTL, the floor of their release time
    assert chat(proxy.url, "c", 700).status_code == 200
    rows = httpx.get(proxy.url + "/admin/sessions", params={"limit": "10"}, timeout=5).json()["data"]
    by_id = {r["id"]: r for r in rows}
    assert by_id["a"]["released"] and not by_id["a"]["active"]  # a was idle longest
    assert not by_id["b"]["released"] and by_id["b"]["active"]
    assert by_id["a"]["gaps"] == 1 and by_id["a"]["turns"] == 2


async def test_a_smaller_session_behind_a_waiter_takes_the_room_it_cannot_use() -> None:
    adm, _ = make()
    await turn(adm, "a", 1000)  # 1,016 of the 1,600-token budget held
    large = asyncio.ensure_future(adm.admit(ctx_for("large", 700)))
    for _ in range(5):
        await asyncio.sleep(0)
    assert len(adm.queue) == 1 and not large.done()  # 1,716 would not fit: it waits
    # 1,316 fits: seated at once rather than left waiting behind the session that does not fit
    small = await asyncio.wait_for(adm.admit(ctx_for("small", 300)), 5)
    assert small.allowed == {"r0"} and small.seat is not None and small.seat.decision == "room"
    assert not large.done() and len(adm.queue) == 1
    large.cancel()
    with pytest.raises(asyncio.CancelledError):
        await large
    assert len(adm.queue) == 0
