"""CPU time of a benchmark's server processes, read from the OS (user + system, every thread)."""

from __future__ import annotations

import time
from pathlib import Path

import psutil


def cpu_seconds(process: psutil.Process) -> float:
    """The CPU seconds ``process`` used so far."""
    times = process.cpu_times()
    return times.user + times.system


def idle_share(process: psutil.Process, seconds: float) -> float:
    """The share of a core ``process`` uses over ``seconds`` while nothing calls it (its own timers
    and checks: what it costs a host at rest).

    An idle proxy uses ~0.01 of a core, and the OS's user/system times count whole 10 ms ticks: over
    a second they often read nothing. So where Linux gives them, its threads' run times in
    nanoseconds (``/proc/<pid>/task/*/schedstat``) are read instead, thread by thread; a thread that
    ends meanwhile takes its share of the window with it, which at rest only a pool's worker would."""
    before = _run_ns(process.pid)
    if not before:
        start = cpu_seconds(process)
        time.sleep(seconds)
        return (cpu_seconds(process) - start) / seconds
    time.sleep(seconds)
    after = _run_ns(process.pid)
    ran = sum(ns - before.get(tid, 0) for tid, ns in after.items())
    return max(ran, 0) / 1e9 / seconds


def _run_ns(pid: int) -> dict[str, int]:
    """Nanoseconds each live thread of ``pid`` has run (empty without ``/proc``'s schedstat)."""
    out: dict[str, int] = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            out[stat.parent.name] = int(stat.read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread ended between the listing and the read
            continue
    return out
