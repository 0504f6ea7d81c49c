"""An idle ``prefixgate serve``: with no traffic its own timers and checks (the loop-lag sampler,
health probes, the replicas' and admission's polls) use a sliver of a core, not nothing and not a
core. Read from the OS: each thread's run time in nanoseconds (``/proc/<pid>/task/*/schedstat``),
since the user/system times count whole 10 ms ticks and over a second often read nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.gateway import serve_process
from tests.helpers.ranks import RankServers

IDLE_SECONDS = 1.0


def run_ns(pid: int) -> dict[str, int]:
    """Nanoseconds each live thread of ``pid`` has run."""
    out: dict[str, int] = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            out[stat.parent.name] = int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread ended between the listing and the read
            continue
    return out


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux's per-thread schedstat")
def test_an_idle_proxy_uses_a_sliver_of_a_core(rank_servers: RankServers) -> None:
    (rank,) = rank_servers.stub(1)
    proxy, _ = serve_process(rank.url)
    with proxy:
        before = run_ns(proxy.pid)
        time.sleep(IDLE_SECONDS)
        after = run_ns(proxy.pid)
    ran_ns = sum(ns - before.get(tid, 0) for tid, ns in after.items())
    core_share = ran_ns / 1e9 / IDLE_SECONDS
    assert 0 < core_share < 0.5
