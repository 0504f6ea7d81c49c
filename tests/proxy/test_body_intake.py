"""How a request body reaches the app through prefixgate's guarded protocol: whole when it fits in
``BODY_BATCH_BYTES`` (one wake-up of the app, not one per 64 KiB), else in pieces of at least that
size, with nothing lost or reordered."""

from __future__ import annotations

import socket
from typing import Any

import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from proxy.connections import BODY_BATCH_BYTES
from proxy.server import ServerThread, ServingOptions


def piece_recording_app() -> tuple[Starlette, list[list[int]]]:
    """An app answering each POST with the sizes of the ``http.request`` messages its body came in."""
    seen: list[list[int]] = []

    async def echo_sizes(request: Request) -> JSONResponse:
        sizes: list[int] = []
        body = bytearray()
        while True:
            message = await request.receive()
            assert message["type"] == "http.request"
            chunk = message.get("body", b"")
            sizes.append(len(chunk))
            body += chunk
            if not message.get("more_body", False):
                break
        seen.append(sizes)
        return JSONResponse({"sizes": sizes, "sum": sum(body) % 251, "length": len(body)})

    app = Starlette(routes=[Route("/echo", echo_sizes, methods=["POST"])])
    app.state.serving = ServingOptions()  # served as prefixgate serves: the guarded protocol
    return app, seen


def post_in_pieces(port: int, body: bytes, piece: int) -> dict[str, Any]:
    """POST ``body`` over a raw socket, ``piece`` bytes per send, and read the JSON answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        head = b"POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
        sock.sendall(head % len(body))
        for start in range(0, len(body), piece):
            sock.sendall(body[start : start + piece])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 200"), answer[:500]
    return orjson.loads(rest.partition(b"\r\n\r\n")[2])


@pytest.fixture
def server() -> Any:
    app, seen = piece_recording_app()
    with ServerThread(app) as thread:
        yield thread, seen


def test_a_body_under_the_batch_reaches_the_app_in_one_message(server):
    thread, _ = server
    body = bytes(range(256)) * (400_000 // 256)  # a 100k-token prompt's size, sent 16 KiB at a time
    answer = post_in_pieces(thread.port, body, 16 * 1024)
    assert answer["sizes"] == [len(body)]
    assert answer["length"] == len(body) and answer["sum"] == sum(body) % 251


def test_a_body_over_the_batch_comes_in_pieces_of_at_least_the_batch(server):
    thread, _ = server
    body = bytes(range(251)) * ((BODY_BATCH_BYTES * 5 // 2) // 251)
    answer = post_in_pieces(thread.port, body, 64 * 1024)
    sizes = answer["sizes"]
    assert len(sizes) >= 2 and sum(sizes) == len(body)
    assert all(size >= BODY_BATCH_BYTES for size in sizes[:-1])
    assert answer["sum"] == sum(body) % 251


def test_a_small_body_and_an_empty_one_are_one_message_each(server):
    thread, _ = server
    assert post_in_pieces(thread.port, b'{"model": "m"}', 3)["sizes"] == [14]
    assert post_in_pieces(thread.port, b"", 1)["sizes"] == [0]
