"""HAProxy (from the OS packages) dealing requests in turn to prefixgate replicas: each request goes
to the next replica, as behind a round-robin Service, so a session's consecutive requests reach
different replicas; a connection a replica refuses is retried on another. Shared by the replica
tests (``tests/helpers/balancer.py``) and ``bench.replica_replay``;
``tests/replicas/install_balancer.sh`` installs HAProxy."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

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
