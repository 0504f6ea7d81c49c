"""``prefixgate serve`` tunes CPython's cyclic garbage collector before it serves
(``proxy.server.tune_collector``): what is alive then is frozen out of every later collection, and
young collections come every ``COLLECTOR_THRESHOLDS[0]`` allocations. Process-wide, so the tuning
itself is checked in a child interpreter, never in the one running the tests."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

from proxy.cli import serve as serve_cmd

CHILD = """
import gc
from proxy.server import COLLECTOR_THRESHOLDS, tune_collector
import proxy.app  # what serve has imported by then
assert gc.get_freeze_count() == 0
tune_collector()
assert gc.get_threshold() == COLLECTOR_THRESHOLDS, gc.get_threshold()
frozen = gc.get_freeze_count()
assert frozen > 10_000, frozen  # the modules' functions, classes and dicts
assert gc.isenabled()

class Node:
    pass

# cycles made afterwards are still found: the collector is tuned, not off
for _ in range(100):
    a, b = Node(), Node()
    a.other, b.other = b, a
del a, b
assert gc.collect() >= 200
print("ok")
"""


def test_tune_collector_freezes_what_is_alive_and_sets_the_thresholds() -> None:
    result = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_serve_tunes_the_collector_once_the_app_is_built_and_before_it_serves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import uvicorn

    import proxy.app
    import proxy.server

    calls: list[str] = []
    real_create_app = proxy.app.create_app

    def create_app(settings):  # type: ignore[no-untyped-def]
        calls.append("create_app")
        return real_create_app(settings)

    monkeypatch.setattr(proxy.app, "create_app", create_app)
    monkeypatch.setattr(proxy.server, "tune_collector", lambda: calls.append("tune_collector"))

    def run(self: uvicorn.Server, sockets: list[socket.socket] | None = None) -> None:
        calls.append("run")
        for sock in sockets or ():  # the socket serve bound for it: closed as uvicorn would
            sock.close()

    monkeypatch.setattr(uvicorn.Server, "run", run)
    parser = argparse.ArgumentParser()
    serve_cmd.configure_parser(parser)
    args = parser.parse_args(["--backend", "http://127.0.0.1:9", "--host", "127.0.0.1", "--port", "0"])
    assert serve_cmd.run(args) == 0
    assert calls == ["create_app", "tune_collector", "run"]
