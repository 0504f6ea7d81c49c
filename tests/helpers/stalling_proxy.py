"""A TCP forwarder that can stall: in front of a server (Redis), it stops answering while every
connection stays open, as a hung (SIGSTOPped) server does, and counts the bytes clients sent it
meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import threading


class StallingProxy:
    """Forwards 127.0.0.1:``port`` to ``target_port``; ``stall()`` holds everything from then on."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.stalled = False
        #: Bytes clients sent while stalled (what they tried on a server that does not answer).
        self.stalled_bytes = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalling-proxy", daemon=True)
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> StallingProxy:
        self._thread.start()
        assert self._ready.wait(10), "the stalling proxy did not start"
        return self

    def stall(self) -> None:
        self.stalled = True

    def stop(self) -> None:
        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()

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
