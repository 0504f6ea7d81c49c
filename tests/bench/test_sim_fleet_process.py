"""``bench.systems.SimFleetProcess``: the simulated fleet every benchmark system runs in front of."""

from __future__ import annotations

import socket

import httpx

from bench.systems import FleetConfig, SimFleetProcess


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
