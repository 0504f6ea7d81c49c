"""When a stream's prefill is done: at its first chunk, unless its API opens with a preamble.

vLLM's Responses stream sends ``response.created`` and ``response.in_progress`` before it awaits
the engine's first output (``Api.stream_preamble``); its prefill is done at the first chunk naming
another event. Chat and Messages streams (their ``message_start`` included) send their first chunk
after the prefill. The router takes a request's prefill off its rank's queue at that moment (the
``prefilled`` event), so a preamble taken for the first token would count the prefill done too soon.
"""

from __future__ import annotations

from collections.abc import Callable

EVENT = b"event:"


def past_preamble(chunk: bytes, preamble: frozenset[bytes]) -> bool:
    """Whether ``chunk`` names an SSE event outside ``preamble`` (every chunk is, for an empty one).

    A chunk cut inside an ``event:`` line names a partial event, which is outside: a cut only ever
    comes after the preamble's events (each is one line) or inside the output that follows them.
    """
    if not preamble:
        return True
    at = chunk.find(EVENT)
    while at >= 0:
        if at == 0 or chunk[at - 1] == 0x0A:  # at a line's start: the event's name
            end = chunk.find(b"\n", at)
            if chunk[at + len(EVENT) : end if end >= 0 else len(chunk)].strip() not in preamble:
                return True
        at = chunk.find(EVENT, at + len(EVENT))
    return False


class PrefillWatch:
    """Calls ``then`` once, at the first chunk past ``preamble``; the relay feeds it until then."""

    def __init__(self, preamble: frozenset[bytes], then: Callable[[], None]) -> None:
        self.preamble = preamble
        self.then = then

    def feed(self, chunk: bytes) -> bool:
        """True once ``then`` has been called (at this chunk): the relay stops feeding it."""
        if not past_preamble(chunk, self.preamble):
            return False
        self.then()
        return True
