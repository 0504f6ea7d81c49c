"""CPU time of a benchmark's server processes, read from the OS (user + system, every thread)."""

from __future__ import annotations

import time

import psutil


def cpu_seconds(process: psutil.Process) -> float:
    """The CPU seconds ``process`` used so far."""
    times = process.cpu_times()
    return times.user + times.system


def idle_share(process: psutil.Process, seconds: float) -> float:
    """The share of a core ``process`` uses over ``seconds`` while nothing calls it (its own timers
    and checks: what it costs a host at rest)."""
    before = cpu_seconds(process)
    time.sleep(seconds)
    return (cpu_seconds(process) - before) / seconds
