"""Client connections: kept open longer than clients keep theirs, closed when a client stalls its
request, capped in number without locking real clients out, and the client address not spoofable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time

import httpx
import pytest

from tests.helpers.gateway import serve_process
from tests.helpers.wait import wait_until
from tests.reliability.conftest import chat

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUEST_LINE = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"


def connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (EOF or reset), after reading whatever it sent."""
    sock.settimeout(0.05)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except TimeoutError:
        return False
    except OSError:
        return True


def read_response(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head


def test_idle_client_connections_outlive_common_client_pools(rank_servers, gateway):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank])
    with connect(proxy.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        head = read_response(sock)
        assert b"\r\nkeep-alive: timeout=75" in head.lower()
        time.sleep(5.5)  # past uvicorn's 5 s default, which equals httpx's pool expiry
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200")


def test_slow_headers_and_silent_connections_are_closed(rank_servers, gateway):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank], header_timeout=1.0)
    trickling = [connect(proxy.url) for _ in range(20)]
    silent = [connect(proxy.url) for _ in range(20)]
    stop = threading.Event()

    def trickle() -> None:  # slowloris: a byte of the headers now and then, never their end
        sent = 0
        while not stop.is_set():
            for sock in trickling:
                with contextlib.suppress(OSError):  # closed by the server: the point of the test
                    sock.send(REQUEST_LINE[sent % len(REQUEST_LINE) : sent % len(REQUEST_LINE) + 1])
            sent += 1
            stop.wait(0.2)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        wait_until(
            lambda: all(closed_by_server(s) for s in trickling + silent),
            "slow or silent connections stayed open",
            timeout=20,
        )
    finally:
        stop.set()
        thread.join(5)
        for sock in trickling + silent:
            sock.close()
    # and real clients are served meanwhile and after
    assert httpx.post(proxy.url + "/v1/chat/completions", json=chat(), timeout=10).status_code == 200


def test_a_stalled_body_gets_a_408(rank_servers, gateway):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank], body_timeout=1.0)
    with connect(proxy.url) as sock:
        sock.sendall(
            REQUEST_LINE + b'content-type: application/json\r\ncontent-length: 1000\r\n\r\n{"model":'
        )
        sock.settimeout(20)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert b"body_timeout" in answer
    assert rank.behavior.received == []


def test_the_connection_cap_closes_idle_connections_first_then_refuses(rank_servers, gateway, caplog):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank], max_connections=10, header_timeout=30.0)
    caplog.set_level(logging.WARNING, logger="prefixgate.connections")
    idle = [connect(proxy.url) for _ in range(30)]  # more idle sockets than the cap
    try:
        # a real client still gets in: the longest-idle connections make room
        for _ in range(3):
            assert httpx.post(proxy.url + "/v1/chat/completions", json=chat(), timeout=10).status_code == 200
        busy = [connect(proxy.url) for _ in range(10)]
        for sock in busy:
            sock.sendall(REQUEST_LINE)  # a request under way: not idle, never closed to make room
        wait_until(lambda: all(closed_by_server(s) for s in idle), "idle connections were not closed")
        with connect(proxy.url) as extra:
            extra.sendall(REQUEST_LINE + b"content-length: 2\r\n\r\n{}")
            assert read_response(extra).startswith(b"HTTP/1.1 503")
        for sock in busy:
            assert not closed_by_server(sock)
            sock.close()
    finally:
        for sock in idle:
            sock.close()
    cap_lines = [r for r in caplog.records if "connection cap of 10 reached" in r.getMessage()]
    assert len(cap_lines) == 1, [r.getMessage() for r in caplog.records]


def test_idle_sockets_past_the_open_files_limit_do_not_lock_clients_out(rank_servers):
    (rank,) = rank_servers.stub(1)
    sockets: list[socket.socket] = []
    proxy, url = serve_process(rank.url, open_files=256)
    with proxy:
        try:
            for _ in range(300):  # more than the process may open at all
                sockets.append(connect(url))
            for i in range(5):
                response = httpx.post(url + "/v1/chat/completions", json=chat(f"real {i}"), timeout=10)
                assert response.status_code == 200
        finally:
            for sock in sockets:
                sock.close()
        log = proxy.log()
    assert log.count("connection cap of") == 1, log[-3000:]
    assert "Too many open files" not in log, log[-3000:]


@pytest.mark.parametrize("trusted", [None, "127.0.0.1"])
def test_x_forwarded_for_is_believed_only_from_trusted_proxies(rank_servers, gateway, caplog, trusted):
    (rank,) = rank_servers.stub(1)
    proxy = gateway([rank], api_keys=["right-key"], trusted_proxies=trusted)
    caplog.set_level(logging.INFO, logger="prefixgate.auth")
    headers = {"authorization": "Bearer wrong-key", "x-forwarded-for": "203.0.113.9"}
    assert httpx.post(proxy.url + "/v1/chat/completions", json=chat(), headers=headers).status_code == 401
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("401 on")]
    assert line.endswith("from 203.0.113.9: invalid" if trusted else "from 127.0.0.1: invalid"), line


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the process's RSS from /proc")
def test_memory_of_unfinished_bodies_goes_back_when_their_clients_leave(rank_servers):
    (rank,) = rank_servers.stub(1)
    bodies, size = 8, 16 * 1024 * 1024
    sockets: list[socket.socket] = []
    proxy, url = serve_process(rank.url)
    with proxy:
        try:
            httpx.post(url + "/v1/chat/completions", json=chat(), timeout=10)  # imports done, warm
            base = resident_mb(proxy.pid)
            piece = b"x" * 65536
            for _ in range(bodies):  # all of each body but its last 64 KiB, then the client stalls
                sock = connect(url)
                sock.sendall(REQUEST_LINE + b"content-length: %d\r\n\r\n" % size)
                for _ in range(size // len(piece) - 1):
                    sock.sendall(piece)
                sockets.append(sock)
            held = bodies * size / 2**20
            wait_until(lambda: resident_mb(proxy.pid) > base + held * 0.8, "the bodies were not buffered")
            for sock in sockets:
                sock.close()
            sockets.clear()
            # the clients left: what their bodies took is the system's again
            wait_until(
                lambda: resident_mb(proxy.pid) < base + held * 0.2,
                lambda: f"RSS {resident_mb(proxy.pid):.0f} MB, {base:.0f} MB before {held:.0f} MB of bodies",
                timeout=20,
            )
            assert httpx.post(url + "/v1/chat/completions", json=chat(), timeout=10).status_code == 200
        finally:
            for sock in sockets:
                sock.close()
        log = proxy.log()
    assert "Traceback" not in log, log[-3000:]  # a client leaving is no error
