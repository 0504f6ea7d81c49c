"""prefixgate in front of test ranks: one way to build, start and stop it for every suite."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from bench.common import Subprocess, proxy_process
from proxy.app import create_app
from proxy.config import load_settings
from proxy.server import ServerThread


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
