"""The socket ``prefixgate serve`` listens on hands asyncio connections it sets TCP_NODELAY on:
without it a response's last small write waits for the client's delayed ACK (~40 ms a request)."""

from __future__ import annotations

import asyncio
import socket

from proxy.server import listen


async def test_accepted_connections_send_without_nagle_delay() -> None:
    listener = listen("127.0.0.1", 0)
    accepted: asyncio.Queue[int] = asyncio.Queue()

    async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        await accepted.put(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_client, sock=listener)
    try:
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(accepted.get(), 10) != 0
        writer.close()
    finally:
        server.close()
        await server.wait_closed()
