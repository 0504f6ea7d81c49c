"""``RankStream``'s watchdog: a rank silent while the relay waits ends the stream; nothing else does."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import SocketTimeoutError

from proxy.stages.forward import RankStream


class _Content:
    """The bits of aiohttp's ``StreamReader`` the stream reads: chunks fed by the test."""

    def __init__(self) -> None:
        self.total_bytes = 0
        self.eof = False
        self._exception: BaseException | None = None
        self._chunks: asyncio.Queue[bytes | BaseException] = asyncio.Queue()

    def feed(self, chunk: bytes) -> None:
        self.total_bytes += len(chunk)
        self._chunks.put_nowait(chunk)

    def is_eof(self) -> bool:
        return self.eof

    def exception(self) -> BaseException | None:
        return self._exception

    def set_exception(self, exc: BaseException) -> None:
        self._exception = exc  # like aiohttp's: raised by every read from now, data buffered or not
        self._chunks.put_nowait(exc)  # wakes a waiting read

    async def readany(self) -> bytes:
        if self._exception is not None:
            raise self._exception
        item = await self._chunks.get()
        if isinstance(item, BaseException):
            raise item
        return item


def _stream(read_timeout: float | None) -> tuple[RankStream, _Content, SimpleNamespace]:
    content = _Content()
    protocol = SimpleNamespace(read_timeout=99.0)  # what aiohttp set for the request
    response = SimpleNamespace(content=content, connection=SimpleNamespace(protocol=protocol))
    return RankStream(cast(Any, response), read_timeout), content, protocol


def test_a_rank_silent_while_the_relay_waits_ends_the_stream():
    async def main() -> None:
        stream, content, protocol = _stream(0.2)
        assert protocol.read_timeout is None  # aiohttp's per-read timer is off: the watchdog keeps time
        content.feed(b"data: 1\n\n")
        assert await stream.__anext__() == b"data: 1\n\n"
        with pytest.raises(SocketTimeoutError):
            await asyncio.wait_for(stream.__anext__(), 5)
        stream.close()

    asyncio.run(main())


def test_a_rank_that_keeps_sending_is_never_cut():
    async def main() -> None:
        stream, content, _ = _stream(0.2)

        async def rank() -> None:
            for i in range(12):  # 1.2 s, six read timeouts, a chunk every half of one
                await asyncio.sleep(0.1)
                content.feed(b"data: %d\n\n" % i)
            content.feed(b"")  # end of stream

        sender = asyncio.create_task(rank())
        received = [chunk async for chunk in stream]
        await sender
        assert len(received) == 12
        stream.close()

    asyncio.run(main())


def test_a_relay_held_up_by_its_client_is_not_a_stalled_rank():
    async def main() -> None:
        stream, content, _ = _stream(0.2)
        content.feed(b"data: 1\n\n")
        content.feed(b"data: 2\n\n")
        assert await stream.__anext__() == b"data: 1\n\n"
        await asyncio.sleep(0.8)  # the relay does not read (its client is slow): four read timeouts
        assert await stream.__anext__() == b"data: 2\n\n"
        stream.close()

    asyncio.run(main())


def test_close_stops_the_watchdog_and_no_timeout_leaves_aiohttps_own():
    async def main() -> None:
        stream, content, _ = _stream(0.2)
        reading = asyncio.create_task(stream.__anext__())
        await asyncio.sleep(0)  # the read is waiting
        stream.close()
        await asyncio.sleep(0.5)  # 2.5 read timeouts: a watchdog still running would end the read
        assert not reading.done()
        content.feed(b"x")
        assert await reading == b"x"
        untimed, content, protocol = _stream(None)
        assert protocol.read_timeout == 99.0  # no watchdog: aiohttp's timer stays in charge
        content.feed(b"y")
        assert await untimed.__anext__() == b"y"

    asyncio.run(main())


def test_a_stream_that_ended_unread_stops_its_watchdog_without_close():
    async def main() -> None:
        stream, content, _ = _stream(0.2)
        content.eof = True  # the rank finished; nobody reads or closes the stream
        await asyncio.sleep(0.3)  # past the first wake-up
        assert stream._handle is None

    asyncio.run(main())
