"""The README's "Try it by hand" block, run as pasted into one shell: its `&`s put `sim` and `serve`
in the background, it waits for /ready, and the second of its two requests shows a hit in both
prefixgate's header and the rank's usage, as the example output under it says."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from bench.sim import DEFAULT_SIM_PORT
from proxy.config import Settings
from tests.test_readme_operator import section

ROOT = Path(__file__).resolve().parents[1]
# the README's ports: serve's default, and the two ranks `sim --ranks 2` starts at its default
SERVE_PORT, FIRST_RANK_PORT = Settings().port, DEFAULT_SIM_PORT


def by_hand_block() -> str:
    lines = section("Try it by hand").split("\n\n")
    block = next(part for part in lines if "prefixgate sim" in part and part.startswith("    "))
    return "\n".join(line.removeprefix("    ") for line in block.splitlines())


def example_output() -> list[str]:
    text = section("Try it by hand")
    after = text.split("both say so:", 1)[1].strip("\n").split("\n\n", 1)[0]
    return [line.strip() for line in after.splitlines()]


def free_port_pair() -> tuple[int, int]:
    """Two consecutive free loopback ports (``sim --ranks 2`` listens on BASE and BASE+1)."""
    for _ in range(50):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            base = first.getsockname()[1]
            if base >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", base + 1))
                except OSError:
                    continue
                return base, base + 1
    raise RuntimeError("no two consecutive free ports")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def on_free_ports(block: str, serve_port: int, rank_port: int) -> str:
    """The block with this checkout's prefixgate and free ports in place of the README's: the
    commands themselves are left as written (`top` gets --once: the live view runs until Ctrl-C)."""
    script = block.replace("prefixgate sim ", f"prefixgate sim --port {rank_port} ", 1)
    script = script.replace("prefixgate serve ", f"prefixgate serve --port {serve_port} ", 1)
    script = script.replace("prefixgate top", f"prefixgate top --once --url http://127.0.0.1:{serve_port}", 1)
    script = script.replace(".venv/bin/prefixgate", f"{shlex.quote(sys.executable)} -m proxy.cli")
    for readme_port, port in (
        (SERVE_PORT, serve_port),
        (FIRST_RANK_PORT, rank_port),
        (FIRST_RANK_PORT + 1, rank_port + 1),
    ):
        script = script.replace(f"127.0.0.1:{readme_port}", f"127.0.0.1:{port}")
    return script


def test_the_block_names_the_readme_ports_and_backgrounds_both_servers():
    block = by_hand_block()
    commands = block.splitlines()
    assert commands[0].startswith(".venv/bin/prefixgate sim") and commands[0].endswith("&")
    assert commands[1].startswith(".venv/bin/prefixgate serve") and commands[1].endswith("&")
    assert f"127.0.0.1:{SERVE_PORT}/ready" in block
    # each request is over one KV block of the simulator's (16 tokens): the second can hit
    assert re.search(r"for turn in 1 2", block)
    assert "x-prefixgate-estimated-cached-tokens" in block


def test_the_block_as_pasted_shows_a_hit_on_the_second_request():
    if shutil.which("curl") is None:
        pytest.skip("the README's block uses curl, which is not installed (apt-get install curl)")
    sim_port, _ = free_port_pair()
    serve_port = free_port()
    script = on_free_ports(by_hand_block(), serve_port, sim_port) + "\nkill %1 %2\nwait\n"
    for readme_port in (SERVE_PORT, FIRST_RANK_PORT, FIRST_RANK_PORT + 1):
        assert f":{readme_port}" not in script, script
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(
        ["bash", "-c", script],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its background jobs are in our process group: killed whatever happens
    )
    try:
        out, err = process.communicate(timeout=90)
    finally:
        # whatever is left of the group: a server the block failed to stop, or all on a timeout
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    found = re.findall(r'x-prefixgate-estimated-cached-tokens: (\d+)|"cached_tokens":(\d+)', out, re.I)
    assert len(found) == 4, out + err
    (first_estimate, _), (_, first_cached), (second_estimate, _), (_, second_cached) = found
    assert int(first_estimate) == 0 and int(first_cached) == 0  # a cold rank: nothing to hit yet
    assert int(second_estimate) > 0 and int(second_cached) > 0, out  # the hit the README promises
    assert int(second_estimate) == int(second_cached)  # prefixgate's estimate is the rank's count
    # the output the README shows is what the block printed
    printed = [line.strip() for line in out.splitlines() if "cached" in line.lower()]
    assert printed == example_output()
    # and the live view's frame came from the same prefixgate
    assert "hit rate" in out and "ranks healthy 2/2" in out
