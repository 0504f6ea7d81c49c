"""A real load balancer (HAProxy, from the OS packages) dealing requests in turn to prefixgate replicas,
on a free loopback port: each request goes to the next replica, so a session's consecutive requests
reach different replicas, as behind a round-robin Service."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

from bench.balancer import haproxy_binary, haproxy_config
from proxy.server import free_port
from tests.helpers.wait import wait_until


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
