"""A TCP forwarder that can stall: in front of a server (Redis), it stops answering while every
connection stays open, as a hung (SIGSTOPped) server does, and counts the bytes clients sent it
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib

from tests.helpers.tcp_server import ThreadedTcpServer


class StallingProxy(ThreadedTcpServer):
    """Forwards 127.0.0.1:``port`` to ``target_port``; ``stall()`` holds everything from then on."""

    def __init__(self, target_port: int) -> None:
        super().__init__("stalling-proxy")
        self.target_port = target_port
        self.stalled = False
        #: Bytes clients sent while stalled (what they tried on a server that does not answer).
        self.stalled_bytes = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stall(self) -> None:
        self.stalled = True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pumps = [
            asyncio.ensure_future(self._pump(reader, up_writer, count=True)),
            asyncio.ensure_future(self._pump(up_reader, writer, count=False)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for end in (writer, up_writer):
                with contextlib.suppress(Exception):
                    end.close()

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, count: bool) -> None:
        while data := await source.read(65536):
            if self.stalled:
                if count:
                    self.stalled_bytes += len(data)
                continue  # held: never forwarded, never answered
            sink.write(data)
            await sink.drain()
