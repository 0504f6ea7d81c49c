"""``--kv-events auto`` across machines: a rank reports the endpoint it bound (vLLM: ``tcp://*:5557``),
which prefixgate must turn into one it can connect to: the rank's own host."""

from __future__ import annotations

import pytest

from routing.kv_sources import reachable


@pytest.mark.parametrize(
    ("bound", "host", "expected"),
    [
        ("tcp://*:5557", "vllm-0", "tcp://vllm-0:5557"),
        ("tcp://0.0.0.0:5557", "10.0.0.5", "tcp://10.0.0.5:5557"),
        ("tcp://[::]:5557", "10.0.0.5", "tcp://10.0.0.5:5557"),
        ("tcp://*:5557", "fd00::5", "tcp://[fd00::5]:5557"),
        ("tcp://10.0.0.7:5557", "vllm-0", "tcp://10.0.0.7:5557"),  # a concrete address is kept
        ("ipc:///tmp/kv.sock", "vllm-0", "ipc:///tmp/kv.sock"),
    ],
)
def test_a_wildcard_bind_is_reached_at_the_ranks_host(bound: str, host: str, expected: str) -> None:
    assert reachable(bound, host) == expected
