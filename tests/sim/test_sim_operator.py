"""``prefixgate sim`` as an operator meets it (issue 21): its own default port, the names to give
``serve``, fault knobs that say what they take, and a refusing rank that can come back over HTTP."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.sim import SimRankServer, cli
from proxy.config import Settings
from tests.helpers.wait import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_sim_and_serve_default_to_different_ports() -> None:
    parser = argparse.ArgumentParser()
    cli.configure_parser(parser)
    assert parser.parse_args([]).port == 8001 != Settings().port == 8000


def test_the_sim_says_how_to_put_prefixgate_in_front() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "sim", "--ranks", "2", "--port", "0", "--time-scale", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        hint = proc.stderr.readline()
        urls = [
            line.split('"url": "')[1].split('"')[0] for line in (proc.stdout.readline() for _ in range(2))
        ]
    finally:
        proc.terminate()
        proc.wait(15)
    assert f"prefixgate serve --backend sim-0={urls[0]} --backend sim-1={urls[1]}" in hint


def test_an_unknown_knob_lists_the_knobs(sim: SimRankServer) -> None:
    answer = httpx.post(f"{sim.url}/sim/faults", json={"latency": 1})
    assert answer.status_code == 400
    message = answer.json()["error"]["message"]
    assert "unknown fault knobs: ['latency']" in message
    for knob in ("latency_s", "error_rate", "refuse_connections", "refuse_for_s", "hang"):
        assert knob in message


@pytest.mark.parametrize(
    ("knob", "value", "fragment"),
    [
        ("latency_s", "slow", "takes float or int"),
        ("hang", 1, "takes bool"),
        ("error_status", True, "takes int"),
    ],
)
def test_a_knob_of_the_wrong_type_is_refused(
    sim: SimRankServer, knob: str, value: object, fragment: str
) -> None:
    answer = httpx.post(f"{sim.url}/sim/faults", json={knob: value})
    assert answer.status_code == 400 and fragment in answer.json()["error"]["message"]
    assert httpx.post(f"{sim.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_rank_refusing_for_a_while_comes_back_by_itself(sim: SimRankServer) -> None:
    set_to = httpx.post(f"{sim.url}/sim/faults", json={"refuse_connections": True, "refuse_for_s": 2.0})
    assert set_to.json()["refuse_connections"] is True and set_to.json()["refuse_for_s"] == 2.0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{sim.url}/health", timeout=2)
    wait_until(
        lambda: httpx.get(f"{sim.url}/health", timeout=2).status_code == 200, retry_on=(httpx.ConnectError,)
    )
    state = httpx.post(f"{sim.url}/sim/faults", json={}).json()
    assert state["refuse_connections"] is False and state["refuse_for_s"] is None
