"""prefixgate in front of test ranks: one way to build, start and stop it for every suite."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.common import stop_process, wait_until_up
from proxy.app import create_app
from proxy.config import load_settings
from proxy.server import ServerThread, free_port


def backend_specs(ranks: Iterable[Any]) -> list[str]:
    """``name=url`` for each rank: anything with ``name`` and ``url``, or a ``(name, url)`` pair."""
    specs = []
    for rank in ranks:
        name, url = rank if isinstance(rank, tuple) else (rank.name, rank.url)
        specs.append(f"{name}={url}")
    return specs


def gateway_app(ranks: Iterable[Any], api_keys: Sequence[str] | None = None, **flags: Any) -> Any:
    """prefixgate's ASGI app over ``ranks`` with ``flags``; the environment is ignored."""
    settings = load_settings(flags=flags, backend_specs=backend_specs(ranks), environ={}, api_keys=api_keys)
    return create_app(settings)


def start_gateway(
    ranks: Iterable[Any], api_keys: Sequence[str] | None = None, timeout: float = 20.0, **flags: Any
) -> ServerThread:
    """prefixgate over ``ranks`` serving on a free loopback port (see ``gateway_app``)."""
    return ServerThread(gateway_app(ranks, api_keys, **flags)).start(timeout)


class Gateways:
    """A suite's ``gateway`` fixture: ``gateways(ranks, **flags)`` starts prefixgate with the suite's
    default flags under ``flags``; ``stop_all()`` stops every one started."""

    def __init__(self, **defaults: Any) -> None:
        self.defaults = defaults
        self.started: list[ServerThread] = []

    def __call__(
        self, ranks: Iterable[Any], api_keys: Sequence[str] | None = None, **flags: Any
    ) -> ServerThread:
        server = start_gateway(ranks, api_keys, **{**self.defaults, **flags})
        self.started.append(server)
        return server

    def stop_all(self) -> None:
        for server in self.started:
            server.stop()


def serve_process(rank_url: str, *flags: str, open_files: int | None = None) -> tuple[Subprocess, str]:
    """``prefixgate serve`` in its own process before ``rank_url`` (not started: use it as a context
    manager) and its URL; its log is kept in a file (``log()``); ``open_files``: its open-files limit."""
    return proxy_process([f"rank={rank_url}"], extra=flags, open_files=open_files)


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
        stop_process(self.proc)
        os.close(self._log_fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self._log_path)


def proxy_process(
    rank_specs: Sequence[str], extra: Sequence[str] = (), open_files: int | None = None
) -> tuple[Subprocess, str]:
    """``prefixgate serve`` in its own process in front of ``rank_specs`` (``--backend`` values:
    ``NAME=URL`` or ``URL``), plus ``extra`` flags; returns it (not started) and its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--log-level", "warning"]
    for spec in rank_specs:
        args += ["--backend", spec]
    args += list(extra)
    return Subprocess(args, url + "/health", open_files=open_files), url
