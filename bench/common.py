"""Helpers shared by the benchmark scripts: subprocess servers, percentiles, output."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx

from proxy.server import free_port

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


def wait_until_up(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not come up within {timeout}s")


class Subprocess:
    """A server in its own process (so it does not share the benchmark client's GIL)."""

    def __init__(
        self,
        args: list[str],
        health_url: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.args = args
        self.health_url = health_url
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Subprocess:
        self.proc = subprocess.Popen(
            self.args, env=self.env, cwd=self.cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            wait_until_up(self.health_url)
        except TimeoutError:
            self.proc.kill()
            err = self.proc.stderr.read().decode() if self.proc.stderr else ""
            raise RuntimeError(f"{' '.join(self.args)} failed to start:\n{err}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def stub_rank_process(port: int | None = None, chunks: int = 3) -> tuple[Subprocess, str]:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "bench.stub_rank", "--port", str(port), "--chunks", str(chunks)]
    return Subprocess(args, url + "/health"), url


def proxy_process(
    rank_specs: Sequence[str],
    port: int | None = None,
    extra: Sequence[str] = (),
    root: Path | None = None,
) -> tuple[Subprocess, str]:
    """``prefixgate serve`` in its own process in front of ``rank_specs`` (``--backend`` values:
    ``NAME=URL`` or ``URL``), plus ``extra`` flags; returns it (not started) and its URL.
    ``root``: run prefixgate from that source tree (e.g. a worktree of another commit)."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--log-level", "warning"]
    for spec in rank_specs:
        args += ["--backend", spec]
    args += list(extra)
    env = {"PYTHONPATH": str(root)} if root is not None else None
    return Subprocess(args, url + "/health", env=env, cwd=root), url


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    """A throw-away ``redis-server`` on a free loopback port: yields its URL, or None when not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        client.close()
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def write_json(name: str, data: dict[str, Any]) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def machine() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "cpus": os.cpu_count(), "platform": sys.platform}
