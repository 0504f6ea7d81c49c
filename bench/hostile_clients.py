"""Hostile clients against one prefixgate process: slowloris, idle sockets past the open-files
limit, unfinished large bodies; and what real clients get meanwhile.

Three phases, each against a fresh ``prefixgate serve`` in front of a stub rank:

- slowloris: ``--slowloris`` connections each sending one byte of a request's headers per second;
  how many are still open after 5, 15 and ``--slowloris-seconds`` seconds, and the real requests
  (one every 0.5 s) answered meanwhile;
- descriptors: prefixgate started with an open-files limit of ``--fd-limit``, then ``--idle``
  connections that send nothing; the real requests answered after them, and the log lines
  prefixgate wrote ("Too many open files", its connection-cap line) in the next ``--fd-seconds``;
- memory: ``--bodies`` clients each sending all of a ``--body-mb`` MB body but its last 64 KiB;
  prefixgate's RSS before, while they wait and after they left.

    python -m bench.hostile_clients [--slowloris 300] [--idle 1100] [--fd-limit 1024] [--bodies 25]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import threading
import time
from typing import Any

import httpx

from bench.common import machine, median, proxy_process, stub_rank_process, write_json

CHAT = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"


class Proxy:
    """``prefixgate serve`` in its own process before the stub rank, started at once."""

    def __init__(self, rank_url: str, fd_limit: int | None = None) -> None:
        self.process, self.url = proxy_process([f"stub={rank_url}"], open_files=fd_limit)
        self.port = int(self.url.rsplit(":", 1)[1])
        self.process.__enter__()

    def rss_mb(self) -> float:
        with open(f"/proc/{self.process.pid}/status") as status:
            return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024

    def stop(self) -> str:
        self.process.__exit__(None, None, None)
        return self.process.log()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def still_open(sock: socket.socket) -> bool:
    """Whether prefixgate still holds ``sock`` open (what it sent before closing is read and dropped)."""
    sock.settimeout(0)
    try:
        while sock.recv(65536):
            pass
    except BlockingIOError:
        return True
    except OSError:
        return False
    return False


def real_request(url: str, timeout: float = 10.0) -> float | None:
    """Seconds a real client's request took, None when it failed."""
    started = time.perf_counter()
    try:
        ok = httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return None
    return time.perf_counter() - started if ok else None


def slowloris(rank_url: str, connections: int, seconds: float) -> dict[str, Any]:
    proxy = Proxy(rank_url)
    socks = [connect(proxy.port) for _ in range(connections)]
    stop = threading.Event()
    real: list[float | None] = []

    def trickle() -> None:
        sent = 0
        while not stop.wait(1.0):
            byte = HEAD[sent % len(HEAD) : sent % len(HEAD) + 1]
            for sock in socks:
                with contextlib.suppress(OSError):  # closed by prefixgate: what is measured
                    sock.send(byte)
            sent += 1

    def clients() -> None:
        while not stop.wait(0.5):
            real.append(real_request(proxy.url))

    threads = [threading.Thread(target=trickle, daemon=True), threading.Thread(target=clients, daemon=True)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    open_at: dict[str, int] = {}
    for mark in sorted({5.0, 15.0, seconds}):
        time.sleep(max(0.0, started + mark - time.monotonic()))
        open_at[f"{mark:g}s"] = sum(1 for s in socks if still_open(s))
    stop.set()
    for thread in threads:
        thread.join(10)
    for sock in socks:
        sock.close()
    proxy.stop()
    answered = [t for t in real if t is not None]
    return {
        "connections": connections,
        "open_after": open_at,
        "real_requests": len(real),
        "real_answered": len(answered),
        "real_p50_ms": median(answered) * 1e3,
    }


def descriptors(rank_url: str, idle: int, fd_limit: int, seconds: float) -> dict[str, Any]:
    proxy = Proxy(rank_url, fd_limit)
    socks = []
    for _ in range(idle):
        try:
            socks.append(connect(proxy.port))
        except OSError:
            break
    started = time.monotonic()
    real: list[float | None] = []
    while time.monotonic() - started < seconds:
        real.append(real_request(proxy.url, timeout=2.0))
    for sock in socks:
        sock.close()
    log = proxy.stop()
    answered = [t for t in real if t is not None]
    return {
        "fd_limit": fd_limit,
        "idle_sockets": len(socks),
        "real_requests": len(real),
        "real_answered": len(answered),
        "real_p50_ms": median(answered) * 1e3,
        "too_many_open_files_lines": log.count("Too many open files"),
        "cap_lines": log.count("connection cap of"),
        "log_lines": len(log.splitlines()),
    }


def memory(rank_url: str, bodies: int, body_mb: int) -> dict[str, Any]:
    proxy = Proxy(rank_url)
    real_request(proxy.url)
    before = proxy.rss_mb()
    size = body_mb * 2**20
    piece = b"x" * 65536
    socks = []
    for _ in range(bodies):
        sock = connect(proxy.port)
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n" % size)
        for _ in range(size // len(piece) - 1):
            sock.sendall(piece)
        socks.append(sock)
    time.sleep(2.0)
    during = proxy.rss_mb()
    for sock in socks:
        sock.close()
    time.sleep(3.0)
    after = proxy.rss_mb()
    proxy.stop()
    return {
        "bodies": bodies,
        "body_mb": body_mb,
        "rss_before_mb": before,
        "rss_during_mb": during,
        "rss_after_mb": after,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slowloris", type=int, default=300)
    parser.add_argument("--slowloris-seconds", type=float, default=30.0)
    parser.add_argument("--idle", type=int, default=1100)
    parser.add_argument("--fd-limit", type=int, default=1024)
    parser.add_argument("--fd-seconds", type=float, default=12.0)
    parser.add_argument("--bodies", type=int, default=25)
    parser.add_argument("--body-mb", type=int, default=30)
    parser.add_argument("--label", default="prefixgate")
    args = parser.parse_args(argv)
    rank, rank_url = stub_rank_process()
    with rank:
        report = {
            "benchmark": "hostile_clients",
            "label": args.label,
            "machine": machine(),
            "slowloris": slowloris(rank_url, args.slowloris, args.slowloris_seconds),
            "descriptors": descriptors(rank_url, args.idle, args.fd_limit, args.fd_seconds),
            "memory": memory(rank_url, args.bodies, args.body_mb),
        }
    path = write_json(f"hostile_clients_{args.label}.json", report)
    s, d, m = report["slowloris"], report["descriptors"], report["memory"]
    print(
        f"{args.label}: slowloris {s['connections']} connections, open after {s['open_after']}, real "
        f"requests answered {s['real_answered']}/{s['real_requests']}; {d['idle_sockets']} idle sockets "
        f"under {d['fd_limit']} fds: real answered {d['real_answered']}/{d['real_requests']}, "
        f"'Too many open files' lines {d['too_many_open_files_lines']}, cap lines {d['cap_lines']}; "
        f"{m['bodies']} x {m['body_mb']} MB unfinished bodies: RSS {m['rss_before_mb']:.0f} -> "
        f"{m['rss_during_mb']:.0f} -> {m['rss_after_mb']:.0f} MB -> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
