"""Helpers shared by the benchmarks: percentiles, free ports, a server coming up, metrics, output."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

OUT_DIR = Path(__file__).resolve().parent / "out"


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; values need not be sorted."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def free_port_run(count: int) -> int:
    """A base port such that ``count`` consecutive ports are free on 127.0.0.1 right now (for
    ``prefixgate sim --ranks N --base-port P``, whose ranks listen on P, P+1, ...)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count >= 65535:
            continue
        ok = True
        for port in range(base, base + count):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError(f"no run of {count} free ports found")


def wait_until_up(url: str, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Return once ``url`` answers below 500 (asked at least once); ``TimeoutError`` after
    ``timeout``, or at once when ``proc`` (the server's process, if given) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise TimeoutError(f"{url}: its process exited ({proc.returncode}) before it came up")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{url} did not come up within {timeout}s")
        time.sleep(0.05)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM ``proc`` and reap it; SIGKILL when it has not exited within 10 s."""
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def metrics_text(url: str) -> str:
    """The Prometheus text at ``url + "/metrics"`` (a loopback server: no proxy from the environment)."""
    return httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text


def metric_totals(url: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` (without a ``_total`` suffix) summed over its labels in the Prometheus text
    at ``url + "/metrics"``; 0 for a metric the server does not have."""
    totals = dict.fromkeys(names, 0.0)
    for line in metrics_text(url).splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def write_json(name: str, data: dict[str, Any], out_dir: Path = OUT_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def positive_count(text: str) -> int:
    """An argparse type for a count of at least 1 (rounds, repeats)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
