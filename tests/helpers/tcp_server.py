"""An asyncio TCP server on 127.0.0.1 in a thread of its own, for hand-written servers in tests
(a rank that drops connections, a forwarder that stalls): subclasses write ``_serve``."""

from __future__ import annotations

import asyncio
import threading
from typing import Self


class ThreadedTcpServer:
    """Listens on a free loopback port once ``start()`` returns; ``stop()`` closes it and cancels
    every connection it is serving."""

    def __init__(self, name: str) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10), f"{self._thread.name} did not start"
        return self

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
        raise NotImplementedError
