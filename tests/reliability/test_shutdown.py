"""SIGTERM on a real ``prefixgate serve`` process: it stops accepting, lets in-flight streams finish
up to ``--shutdown-timeout``, then exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from proxy.server import free_port
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until
from tests.reliability.conftest import chat, sse_events

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def start_serve(rank_url: str, shutdown_timeout: float) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXGATE_")}
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "proxy.cli", "serve", "--backend", f"stub={rank_url}"),
            *("--port", str(port), "--shutdown-timeout", str(shutdown_timeout), "--log-level", "warning"),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        return httpx.get(url + "/health", timeout=1).status_code == 200

    wait_until(healthy, "prefixgate serve did not start", 20, 0.1, retry_on=(httpx.TransportError,))
    return proc, url


class StreamReader(threading.Thread):
    """Streams one completion in the background; ``first_chunk`` is set once bytes arrive."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.max_tokens = max_tokens
        self.first_chunk = threading.Event()
        self.text = ""
        self.error: Exception | None = None

    def run(self) -> None:
        body = chat("slow one", stream=True, max_tokens=self.max_tokens)
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=30) as response:
                for piece in response.iter_text():
                    self.text += piece
                    self.first_chunk.set()
        except httpx.HTTPError as exc:
            self.error = exc
        self.first_chunk.set()


def refuses_connections(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


@contextmanager
def streaming_through_serve(
    rank_servers: RankServers, chunks: int, shutdown_timeout: float
) -> Iterator[tuple[subprocess.Popen[bytes], str, StreamReader]]:
    """``prefixgate serve`` before a stub rank streaming ``chunks`` chunks 0.25 s apart, with one stream
    in flight (its first bytes received); the process is killed on the way out."""
    (rank,) = rank_servers.stub(1, chunks=chunks, chunk_delay=0.25)
    proc, url = start_serve(rank.url, shutdown_timeout)
    try:
        reader = StreamReader(url, max_tokens=chunks)
        reader.start()
        assert reader.first_chunk.wait(10)
        yield proc, url, reader
    finally:
        proc.kill()
        proc.wait(5)


def test_sigterm_finishes_the_in_flight_stream_and_refuses_new_ones(rank_servers):
    # a 2 s stream
    with streaming_through_serve(rank_servers, chunks=8, shutdown_timeout=20) as (proc, url, reader):
        proc.send_signal(signal.SIGTERM)
        wait_until(lambda: refuses_connections(url), "still accepting connections after SIGTERM", timeout=5)
        assert reader.is_alive(), "the stream ended before the shutdown let it finish"
        reader.join(15)
        assert not reader.is_alive() and reader.error is None
        events = sse_events(reader.text)
        assert events[-1] == "[DONE]" and len([e for e in events if isinstance(e, dict)]) >= 8
        # uvicorn re-raises the signal once it has shut down: the exit status says "ended by SIGTERM"
        assert proc.wait(15) in (0, -signal.SIGTERM)


def test_sigterm_cuts_streams_that_outlive_the_deadline(rank_servers):
    # a 10 s stream
    with streaming_through_serve(rank_servers, chunks=40, shutdown_timeout=0.5) as (proc, _, reader):
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert time.monotonic() - signalled < 5, "shutdown did not keep to --shutdown-timeout"
        reader.join(10)
        assert not reader.is_alive()
        assert "[DONE]" not in reader.text  # cut, not completed


def test_a_stream_cut_by_the_shutdown_deadline_ends_with_an_error_event(rank_servers):
    with streaming_through_serve(rank_servers, chunks=40, shutdown_timeout=0.5) as (proc, _, reader):
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        reader.join(10)
        assert not reader.is_alive() and reader.error is None  # the stream ended cleanly, cut
    events = sse_events(reader.text)  # every event decodes
    assert "[DONE]" not in events
    error = events[-1]["error"]
    assert "shutting down" in error["message"] and error["type"] == "upstream_error"
