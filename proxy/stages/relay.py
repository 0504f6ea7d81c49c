"""Stage 7, stream: relay an opened upstream stream to the client chunk by chunk.

Chunks are relayed as they arrive, never buffered or parsed beyond the SSE well-formedness check;
the last few are kept to read the usage from (vLLM sends it last). A break (the rank dies, stalls
past ``read_timeout`` or sends an undecodable event) ends the stream with an SSE error event in the
client API's shape, and so does a stream the server cuts (the shutdown deadline passed: uvicorn
cancels the request), so the client knows its answer is incomplete. A client that goes away cancels
the upstream request. Whatever happens, the rank's in-flight count is released and ``on_done`` runs
exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.apis.base import Translation
from proxy.stages.disconnect import cancel_on_disconnect, fired
from proxy.stages.forward import Opened, response_headers
from proxy.stages.preamble import PrefillWatch

log = logging.getLogger("prefixgate.forward")

#: The tail of a stream kept to read its usage chunk (vLLM sends it as one chunk near the end).
STREAM_TAIL_CHUNKS = 4


class MalformedStream(Exception):
    """The rank's SSE stream holds an event that does not decode."""


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """How a relayed stream ended: its first and last chunks, why it broke, whether the client left."""

    first: bytes
    tail: tuple[bytes, ...]
    error: str | None
    disconnected: bool
    first_byte_at: float


class RelayResponse(Response):
    """Relays an opened upstream stream chunk by chunk, watching for the client going away."""

    def __init__(
        self,
        opened: Opened,
        on_done: Callable[[StreamOutcome], None],
        error_event: Callable[[str], bytes],
        translation: Translation | None = None,
        end_marker: bytes | None = None,
        prefill: PrefillWatch | None = None,
    ) -> None:
        """``error_event`` renders the event that ends a broken stream, in the client API's own shape;
        ``translation`` turns the rank's chunks into the client API's (None: relayed as they are);
        ``end_marker`` starts the SSE line of the stream's last event: the outcome is reported before
        the chunk holding it is sent, so a client that asks again at once finds this answer counted.
        It is matched only at a line's start, where no event's text can put it (JSON escapes
        newlines). ``prefill``: fed the chunks after the first until it says the rank's prefill is
        done (a stream whose first chunk was its API's preamble, ``proxy/stages/preamble.py``)."""
        self.opened = opened
        self.on_done = on_done
        self.error_event = error_event
        self.translation = translation
        self.status_code = opened.response.status
        self.background = None
        self.init_headers(response_headers(opened.response, opened.rank.name))
        self._tail: deque[bytes] = deque(maxlen=STREAM_TAIL_CHUNKS)
        self._error: str | None = None
        self._completed = False
        self._first_byte_at = time.perf_counter()
        self._settled = False
        #: Why the server cut the stream (its request was cancelled), if it did.
        self._cut: str | None = None
        self._reported = False
        self._watcher: asyncio.Task[bool] | None = None
        self._end_line = None if end_marker is None else b"\n" + end_marker
        self.end_marker = end_marker
        self._prefill = prefill

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The relay runs in the request's own task, which the watcher cancels when the client leaves
        # (one task a stream, no asyncio.wait: proxy/stages/disconnect.py).
        current = asyncio.current_task()
        assert current is not None, "a response is sent from a task"
        self._watcher = watcher = asyncio.ensure_future(cancel_on_disconnect(receive, current))
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not fired(watcher):
                raise  # the server ended the request (shutdown): the relay sent the cut's event
            current.uncancel()  # the client left: nothing more to send
        else:
            if fired(watcher):  # it left as the stream ended, and the relay finished anyway
                current.uncancel()
        finally:
            watcher.cancel()
            self._settle()  # a relay cancelled before it started never ran its own cleanup

    async def _relay(self, send: Send) -> None:
        opened = self.opened
        rank = opened.rank
        tail = self._tail
        translate = self.translation
        self._first_byte_at = time.perf_counter()
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            first = opened.first_chunk
            ends = self._ends
            if first:
                tail.append(first)
                if ends(first):
                    self._report(left=False)
                out = translate.chunk(first) if translate is not None else first
                await send({"type": "http.response.body", "body": out, "more_body": True})
            assert opened.chunks is not None
            try:
                checker = opened.checker
                async for chunk in opened.chunks:
                    problem = checker.feed(chunk) if checker is not None else None
                    if problem is not None:  # end the stream here rather than relay what clients cannot parse
                        raise MalformedStream(problem)
                    tail.append(chunk)
                    if self._prefill is not None and self._prefill.feed(chunk):
                        self._prefill = None
                    if not self._reported and ends(chunk):
                        self._report(left=False)
                    out = translate.chunk(chunk) if translate is not None else chunk
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            except (aiohttp.ClientError, TimeoutError, MalformedStream) as exc:
                error = f"{rank.name} broke mid-stream: {type(exc).__name__}"
                if isinstance(exc, MalformedStream):
                    error = f"{rank.name} sent a {exc}"
                self._error = error
                log.warning("%s", error)
                await send({"type": "http.response.body", "body": self.error_event(error), "more_body": True})
            end = translate.end() if translate is not None else b""
            await send({"type": "http.response.body", "body": end, "more_body": False})
            self._completed = True
        except asyncio.CancelledError:
            if not fired(self._watcher):
                # not the client leaving (the watcher's): the server ended the request, which at
                # shutdown means the stream outlived --shutdown-timeout
                self._cut = cut = "prefixgate is shutting down: the stream was cut at its shutdown timeout"
                self._error = cut
                log.warning("%s: %s", rank.name, cut)
                with contextlib.suppress(Exception):  # best effort: the connection may be gone
                    await send(
                        {"type": "http.response.body", "body": self.error_event(cut), "more_body": False}
                    )
            raise
        finally:
            self._settle()

    def _ends(self, chunk: bytes) -> bool:
        """Whether ``chunk`` holds the stream's last event (the end marker at a line's start)."""
        marker, line = self.end_marker, self._end_line
        return marker is not None and line is not None and (chunk.startswith(marker) or line in chunk)

    def _settle(self) -> None:
        """Release the rank and report the outcome (unless the last event did already), once."""
        if self._settled:
            return
        self._settled = True
        # the connection is reused only after a whole stream; else its state is unknown
        self.opened.close(reusable=self._completed and self._error is None)
        self._report(left=not self._completed and self._cut is None)  # a cut stream is an error

    def _report(self, *, left: bool) -> None:
        """Tell ``on_done`` how the stream ended (``left``: the client went away first), once."""
        if self._reported:
            return
        self._reported = True
        opened = self.opened
        self.on_done(
            StreamOutcome(opened.first_chunk, tuple(self._tail), self._error, left, self._first_byte_at)
        )
