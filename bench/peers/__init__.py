"""Peer routers for side-by-side benchmarks: sglang-router and vllm-router, offline, on loopback.

``install.sh`` puts both in a virtualenv outside the repository (``peers_dir()``); ``PeerRouter``
starts one in front of given rank URLs (its ``--worker-urls``) and stops it. Both are Rust binaries
behind a Python wrapper that rename their process, so the PID (for CPU accounting) is found from the
listening port. See ``/work/shared/specs/peers.md`` for what was seen working here.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import psutil

from bench.common import stop_process, wait_until_up
from proxy.server import free_port

INSTALL_SCRIPT = Path(__file__).resolve().parent / "install.sh"

# Any outbound attempt (tokenizer downloads for the ranks' model) fails locally and at once.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "HTTP_PROXY": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost",
}


@dataclass(frozen=True, slots=True)
class PeerSpec:
    """One peer system: which router, which policy."""

    name: str
    router: str  # "sglang" or "vllm"
    policy: str


PEERS: tuple[PeerSpec, ...] = (
    PeerSpec("sglang cache_aware", "sglang", "cache_aware"),
    PeerSpec("vllm-router cache_aware", "vllm", "cache_aware"),
    PeerSpec("vllm-router consistent_hash", "vllm", "consistent_hash"),
)


def peers_dir() -> Path:
    """The peers' virtualenv: ``$PREFIXGATE_PEERS_DIR`` or ``~/.cache/prefixgate/peers``."""
    env = os.environ.get("PREFIXGATE_PEERS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "prefixgate" / "peers"


def installed(directory: Path | None = None) -> bool:
    directory = directory or peers_dir()
    return (directory / "bin" / "vllm-router").exists() and (directory / "bin" / "python").exists()


def listening_pid(port: int) -> int | None:
    """The PID of the process listening on 127.0.0.1:``port`` (the routers rename themselves)."""
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
            return conn.pid
    return None


class PeerRouter:
    """A peer router process in front of ``rank_urls``; a context manager that starts and stops it."""

    def __init__(
        self,
        spec: PeerSpec,
        rank_urls: Sequence[str],
        directory: Path | None = None,
        log: Path | None = None,
    ) -> None:
        self.spec = spec
        self.rank_urls = list(rank_urls)
        self.directory = directory or peers_dir()
        self.port = free_port()
        self.metrics_port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid: int | None = None
        self._log_handle: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        if self.spec.router == "sglang":
            head = [str(self.directory / "bin" / "python"), "-m", "sglang_router.launch_router"]
        else:
            head = [str(self.directory / "bin" / "vllm-router")]
        return [
            *head,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--worker-urls",
            *self.rank_urls,
            "--policy",
            self.spec.policy,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.metrics_port),
            "--log-level",
            "warn" if self.spec.router == "sglang" else "warning",  # the two CLIs spell it differently
        ]

    def start(self, timeout: float = 60.0) -> PeerRouter:
        if not installed(self.directory):
            raise RuntimeError(f"peer routers not installed in {self.directory}: run {INSTALL_SCRIPT}")
        if self.log is not None:
            self._log_handle = open(self.log, "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            self.command(),
            env={**os.environ, **OFFLINE_ENV},
            stdout=self._log_handle or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_until_up(self.url + "/v1/models", timeout, self.proc)
        except TimeoutError as exc:
            self.stop()
            raise RuntimeError(f"{self.spec.name}: {exc} (log: {self.log})") from exc
        self.pid = listening_pid(self.port)
        return self

    def stop(self) -> None:
        if self.proc is None:
            return
        # The wrapper may have re-executed itself under another name: stop the listener too.
        targets = [self.proc.pid] + ([self.pid] if self.pid and self.pid != self.proc.pid else [])
        for pid in targets:
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).terminate()
        stop_process(self.proc)
        if self.pid and psutil.pid_exists(self.pid):
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(self.pid).kill()
        self.proc = None
        if self._log_handle is not None:
            self._log_handle.close()
            self._log_handle = None

    def __enter__(self) -> PeerRouter:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
