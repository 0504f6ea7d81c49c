"""CPU time of a benchmark's server processes, read from the OS (user + system, every thread)."""

from __future__ import annotations

import psutil


def cpu_seconds(process: psutil.Process) -> float:
    """The CPU seconds ``process`` used so far."""
    times = process.cpu_times()
    return times.user + times.system

