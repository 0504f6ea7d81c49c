"""What admission learns from the traffic does not depend on how many replicas share it: replicas
on one session table read the think gaps and request durations from that table, so each learns its
clocks from all of the traffic, not from the share it served."""

from __future__ import annotations

from proxy.admission import Admission, AdmissionConfig
from proxy.config import DEFAULT_WAIT_S
from proxy.state.memory import MemorySessionStore
from proxy.state.sessions import SessionTable
from routing.ranks import Fleet, Rank
from tests.admission.test_release import BLOCK, POOL, TTL, Clock, turn

SESSIONS = 12
TURNS = 5


def replicas(count: int, clock: Clock, wait: float | None = 0.0) -> list[Admission]:
    """``count`` admissions over one session table (a shared store), as replicas on one Redis."""
    table = SessionTable(MemorySessionStore(), TTL, clock)
    config = AdmissionConfig(idle_ttl=TTL, wait=wait, block_size=BLOCK)
    return [
        Admission(table, Fleet([Rank("r0", "http://r0", pool_tokens=POOL * 100)]), config, None)
        for _ in range(count)
    ]


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
                adm.time.wait_bound() != DEFAULT_WAIT_S and 1.0,  # measured in real time: known or not
                len(adm.time.gaps),
            )
            for adm in admissions
        ]
    (alone,) = learned[1]
    assert alone[0] == 4.0 and alone[3] == SESSIONS * (TURNS - 1)
    assert alone[2] == 1.0  # durations learned
    assert learned[3] == [alone, alone, alone]
