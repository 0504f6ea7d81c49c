"""A real load balancer (HAProxy, from the OS packages) dealing requests in turn to prefixgate replicas,
on a free loopback port: each request goes to the next replica, so a session's consecutive requests
reach different replicas, as behind a round-robin Service; a connection a replica refuses is retried
on another. ``tests/replicas/install_balancer.sh`` installs HAProxy."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

from proxy.server import free_port
from tests.helpers.wait import wait_until

CONFIG = """\
global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
    option http-server-close
    # forward each streamed chunk at once: by default HAProxy sends with MSG_MORE, which lets the
    # kernel hold a stream's small chunks (its first token) until more data comes or ~200 ms pass
    option http-no-delay
    # a replica that stopped listening (shut down, restarting) refuses the connection: try again on
    # another replica rather than fail the request
    retries 3
    option redispatch 1
frontend prefixgate
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
{servers}
"""


def haproxy_binary() -> str:
    found = shutil.which("haproxy") or ("/usr/sbin/haproxy" if Path("/usr/sbin/haproxy").exists() else None)
    if found is None:
        raise RuntimeError("haproxy is not installed: tests/replicas/install_balancer.sh installs it")
    return found


def haproxy_config(port: int, urls: Sequence[str]) -> str:
    """HAProxy's configuration: listen on loopback ``port``, deal requests to ``urls`` in turn."""
    servers = "\n".join(f"    server r{i} {url.removeprefix('http://')}" for i, url in enumerate(urls))
    return CONFIG.format(port=port, servers=servers)


class Balancer:
    """``Balancer(urls).start()``: HAProxy in front of ``urls`` (round robin per request)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.port = free_port()
        self._dir = tempfile.mkdtemp(prefix="prefixgate-haproxy-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Balancer:
        config = Path(self._dir) / "haproxy.cfg"
        config.write_text(haproxy_config(self.port, self.urls))
        self.proc = subprocess.Popen(
            [haproxy_binary(), "-db", "-f", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )

        def listening() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self._stderr()
            httpx.get(self.url + "/health", timeout=1)
            return True

        wait_until(listening, "haproxy did not start", 10, 0.05, retry_on=(httpx.TransportError,))
        return self

    def _stderr(self) -> str:
        if self.proc is None or self.proc.stderr is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Balancer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
