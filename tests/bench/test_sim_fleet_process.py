"""``bench.systems.SimFleetProcess``: the simulated fleet every benchmark system runs in front of."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from bench import systems
from bench.systems import FleetConfig, SimFleetProcess
from proxy.server import free_port


def test_a_fleet_whose_port_was_taken_before_it_bound_starts_on_other_ports() -> None:
    fleet = SimFleetProcess(FleetConfig(ranks=2, kv_tokens=10_000))
    taken_port = fleet.base_port + 1
    with socket.socket() as taken:  # another process's socket lands on a chosen port meanwhile
        taken.bind(("127.0.0.1", taken_port))
        taken.listen()
        fleet.start()
        try:
            assert fleet.base_port != taken_port - 1
            for url in fleet.urls:
                assert httpx.get(url + "/health", timeout=5).status_code == 200
        finally:
            fleet.stop()


def test_prefixgate_whose_port_was_taken_before_it_bound_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:  # another process's socket lands on the chosen port meanwhile
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1], free_port()])
        monkeypatch.setattr(systems, "free_port", lambda: next(ports))
        with systems._prefixgate(
            "round_robin", ["http://127.0.0.1:9"], tmp_path / "log", [], None
        ) as running:
            assert running.url != f"http://127.0.0.1:{taken.getsockname()[1]}"
            assert httpx.get(running.url + "/health", timeout=5).status_code == 200
    assert "already in use" in (tmp_path / "log").read_text()  # the first try said why it stopped
