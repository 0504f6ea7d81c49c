"""``prefixgate serve --workers N``: N processes on one port, one shared state (an embedded Redis when
no ``--redis-url`` is given), stopped together."""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from proxy.server import free_port
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]


def serve(args: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--log-level", "info", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        return httpx.get(url + "/health", timeout=1).status_code == 200

    wait_until(healthy, "prefixgate serve --workers did not start", 60, 0.1, retry_on=(httpx.TransportError,))
    return proc, url


def embedded_dirs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("prefixgate-redis-*"))


def test_workers_share_one_session_table_and_stop_together(rank_servers: RankServers) -> None:
    ranks = rank_servers.sim(2)
    before = embedded_dirs()
    proc, url = serve(["--workers", "2", *(f"--backend={r.name}={r.url}" for r in ranks)])
    try:
        workers = psutil.Process(proc.pid).children(recursive=True)
        serving = [w for w in workers if "redis" not in " ".join(w.cmdline())]
        embedded = [w for w in workers if "redis" in " ".join(w.cmdline())]
        assert len(embedded) == 1  # no --redis-url: the supervisor started one for the workers
        assert len([w for w in serving if w.pid != proc.pid]) >= 2
        body = {
            "model": "sim",
            "messages": [{"role": "user", "content": "shared state " * 80}],
            "max_tokens": 4,
        }
        seen = set()
        for _ in range(12):  # new connections each time: the kernel deals them across the workers
            answer = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": "w1"})
            assert answer.status_code == 200
            seen.add(answer.headers["x-prefixgate-backend"])
        assert len(seen) == 1  # one session, one rank, whichever worker answered
        session = httpx.get(url + "/admin/sessions/w1").json()
        assert session["turns"] == 12  # every worker counted into the same record
        (socket_dir,) = embedded_dirs() - before  # its private directory, with the unix socket
        assert (socket_dir / "redis.sock").exists()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    wait_until(
        lambda: not any(p.is_running() for p in embedded), "the embedded Redis outlived prefixgate", 10
    )
    assert not socket_dir.exists()


def listening_sockets(proc: subprocess.Popen[bytes], port: int) -> dict[int, int]:
    """The workers' listening sockets on ``port``: socket inode -> the worker's pid."""
    found: dict[int, int] = {}
    for worker in psutil.Process(proc.pid).children(recursive=True):
        for conn in worker.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port:
                link = os.readlink(f"/proc/{worker.pid}/fd/{conn.fd}")  # "socket:[INODE]"
                found[int(link[len("socket:[") : -1])] = worker.pid
    return found


def test_each_worker_listens_on_a_socket_of_its_own_and_connections_spread(rank_servers: RankServers) -> None:
    """With SO_REUSEPORT each worker accepts from its own queue and the kernel deals new connections
    over them by address: a burst of keep-alive clients reaches both workers, instead of whichever
    worker woke first on one shared socket."""
    ranks = rank_servers.sim(1)
    proc, url = serve(["--workers", "2", *(f"--backend={r.name}={r.url}" for r in ranks)])
    port = int(url.rsplit(":", 1)[1])
    clients = [httpx.Client(base_url=url) for _ in range(24)]
    try:
        wait_until(lambda: len(listening_sockets(proc, port)) == 2, "two workers never listened apart", 60)
        sockets = listening_sockets(proc, port)
        assert len(set(sockets.values())) == 2  # two sockets, one in each worker
        for client in clients:  # each keeps its connection open
            assert client.get("/health").status_code == 200
        held: dict[int, int] = {}
        for worker in set(sockets.values()):
            conns = psutil.Process(worker).net_connections(kind="tcp")
            held[worker] = sum(
                1 for c in conns if c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port
            )
        assert sum(held.values()) == len(clients)
        assert all(held.values()), held  # all 24 on one worker: a chance of 2 in 2**24 when hashed
    finally:
        for client in clients:
            client.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def announced_port(proc: subprocess.Popen[bytes], pattern: str, timeout: float = 60) -> int:
    """The port in the first line of ``proc``'s stderr that matches ``pattern`` (one group)."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stderr], [], [], 0.5)
        if not ready:
            continue
        line = proc.stderr.readline().decode()
        assert line, "prefixgate serve exited:\n" + "".join(seen)
        seen.append(line)
        if found := re.search(pattern, line):
            return int(found.group(1))
    raise AssertionError("never announced its port:\n" + "".join(seen))


def test_workers_on_port_0_all_listen_on_the_port_the_system_chose_and_the_log_names_it(
    rank_servers: RankServers,
) -> None:
    ranks = rank_servers.sim(1)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--port", "0", "--workers", "2", "--log-level", "info"]
        + [f"--backend={r.name}={r.url}" for r in ranks],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        port = announced_port(proc, r"2 workers on 127\.0\.0\.1:(\d+)")
        assert port != 0
        # each worker binds the announced port (SO_REUSEPORT), none a port of its own choosing
        wait_until(lambda: len(listening_sockets(proc, port)) == 2, "two workers never listened there", 60)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
