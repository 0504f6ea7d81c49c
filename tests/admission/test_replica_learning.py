"""What admission learns from the traffic does not depend on how many replicas share it: replicas
on one session table count the quiet spells that closed and those that ended from that table, so
each finds the share of sessions' last spells that one replica serving everything finds; and they
read the think gaps and request durations from it too, so each learns its clocks from all of the
traffic, not from the share it served."""

from __future__ import annotations

from proxy.admission import Admission, AdmissionConfig
from proxy.state.memory import MemorySessionStore
from proxy.state.sessions import SessionTable
from routing.ranks import Fleet, Rank
from tests.admission.test_release import BLOCK, POOL, TTL, Clock, turn

SESSIONS = 12
TURNS = 5


def replicas(count: int, clock: Clock, wait: float | None = 0.0) -> list[Admission]:
    """``count`` admissions over one session table (a shared store), as replicas on one Redis."""
    table = SessionTable(MemorySessionStore(), TTL, clock)
    config = AdmissionConfig(idle_ttl=TTL, wait=wait, block_size=BLOCK, policy="budget")
    return [
        Admission(table, Fleet([Rank("r0", "http://r0", pool_tokens=POOL * 100)]), config, None)
        for _ in range(count)
    ]


async def ended_shares(count: int) -> list[float | None]:
    """Every session takes ``TURNS`` turns 1 s apart, dealt to the replicas in turn, then ends (idle
    past the TTL); each replica refreshes as its gateway does. Each replica's share of ended spells."""
    clock = Clock()
    admissions = replicas(count, clock)
    dealt = 0
    for n in range(TURNS):
        for s in range(SESSIONS):
            await turn(admissions[dealt % count], f"s{s}", 100 + 10 * n)
            dealt += 1
        clock.now += 1.0
        for adm in admissions:
            adm.refresh()
    clock.now += TTL + 1  # every session ends
    for adm in admissions:
        adm.refresh()
    return [adm.time.ended_share() for adm in admissions]


async def test_replicas_on_one_table_learn_the_share_of_ended_spells_one_replica_learns() -> None:
    (alone,) = await ended_shares(1)
    # 12 sessions: 4 returns each and 1 end each -> 12 of 60 spells were their last
    assert alone == SESSIONS / (SESSIONS * TURNS)
    assert await ended_shares(2) == [alone, alone]
    assert await ended_shares(3) == [alone, alone, alone]


async def test_a_session_back_after_ending_counts_its_new_returns_only() -> None:
    """Sessions of 3 turns end, come back for one more turn and end again: 2 + 1 returns and 2 ends
    each, whatever the counts their records carried before they ended."""
    clock = Clock()
    (adm,) = replicas(1, clock)
    keys = [f"s{i}" for i in range(5)]
    for _ in range(3):
        for key in keys:
            await turn(adm, key, 100)
        clock.now += 1.0
        adm.refresh()
    for _ in range(2):
        clock.now += TTL + 1
        adm.refresh()  # all ended
        for key in keys:
            await turn(adm, key, 100)  # back
        adm.refresh()
    clock.now += TTL + 1
    adm.refresh()
    assert adm.time.ended_share() == (3 * 5) / ((2 + 2 + 3) * 5)


async def test_replicas_on_one_table_learn_every_think_gap_and_request_duration() -> None:
    """Sessions dealt to the replicas in turn, rounds of growing think gaps: each replica learns the
    distribution of think gaps one replica learns and the duration of every session's latest answer,
    though it served a third of them. Learned from its own requests only, each of three replicas
    saw 16 of the 48 gaps, under the 20 a typical gap needs."""
    learned: dict[int, list[tuple[float | None, float | None, float | None, int]]] = {}
    for count in (1, 3):
        clock = Clock()
        admissions = replicas(count, clock, wait=None)
        dealt = 0
        for n in range(TURNS):
            for s in range(SESSIONS):
                await turn(admissions[dealt % count], f"s{s}", 100 + 10 * n)
                dealt += 1
            for adm in admissions:
                adm.refresh()
            clock.now += 1.0 + n  # the think gap before round n + 1
        learned[count] = [
            (
                adm.time.typical_gap(),
                adm.time.gaps.quantile(0.5),
                adm.time.request_seconds() and 1.0,  # measured in real time: known or not
                len(adm.time.gaps),
            )
            for adm in admissions
        ]
    (alone,) = learned[1]
    assert alone[0] == 4.0 and alone[3] == SESSIONS * (TURNS - 1)
    assert alone[2] == 1.0  # durations learned
    assert learned[3] == [alone, alone, alone]
