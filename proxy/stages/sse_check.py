"""Checks that a rank's SSE stream is well-formed while it is relayed.

A rank that emits an undecodable ``data:`` event would hand the client garbage its SDK cannot
parse; prefixgate stops the stream at the first such event instead (with an SSE error event), or
retries on another rank when the bad event is in the first chunk, before anything was sent.

Only complete lines are checked: a chunk boundary may fall anywhere, so the unterminated tail of a
chunk waits for the next one. Each event's data is validated once, the only way to tell a truncated
JSON object from a whole one: by msgspec into a ``Raw`` (its syntax is checked, no Python object is
built: 0.18 us for a token's event where orjson's parse took 0.6 us), plus its UTF-8. A chunk that
is one whole single-line event (a streamed token's, nearly every chunk) is checked without being
split into lines. Measured in place (two proxies side by side, one-line requests streaming 64 chunks,
16 alternating rounds): 8.30 against 8.95 ms of CPU per request, ~10 us a chunk of the ~100.
"""

from __future__ import annotations

import msgspec

#: Longest line accepted without a newline; a rank streaming more without one is broken.
MAX_PENDING_BYTES = 8 * 1024 * 1024
DONE = b"[DONE]"


class SseChecker:
    """Feed it the stream's chunks in order; ``feed`` returns a description of the first defect."""

    __slots__ = ("_data", "_pending")

    def __init__(self) -> None:
        self._pending = b""
        self._data: list[bytes] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> str | None:
        """None while the stream is well-formed, else what is wrong with it."""
        if (
            not self._pending
            and chunk.startswith(b"data: {")
            and chunk.endswith(b"\n\n")
            and chunk.find(b"\n", 7) == len(chunk) - 2
            and not self._data
        ):
            return _malformed(chunk[6:-2])
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._pending = data
            if len(data) > MAX_PENDING_BYTES:
                return f"a line longer than {MAX_PENDING_BYTES} bytes"
            return None
        self._pending = data[end + 1 :]
        for line in data[:end].split(b"\n"):
            line = line.rstrip(b"\r")
            if not line:  # a blank line ends the event
                if self._data:
                    problem = self._check_event()
                    if problem is not None:
                        return problem
                continue
            if line.startswith(b"data:"):
                self._data.append(line[5:].lstrip(b" "))
        return None

    def _check_event(self) -> str | None:
        parts, self._data = self._data, []
        payload = parts[0] if len(parts) == 1 else b"\n".join(parts)
        return None if payload == DONE else _malformed(payload)


_VALIDATOR = msgspec.json.Decoder(msgspec.Raw)


def _malformed(payload: bytes) -> str | None:
    """What is wrong with an event's data (one JSON value, in UTF-8), or None."""
    try:
        _VALIDATOR.decode(payload)
        payload.decode()  # msgspec leaves the bytes inside strings unchecked
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # where, not what: the event is completion text, which logs and clients must not get
        return f"malformed SSE event: {len(payload)} bytes of data, {exc}"
    return None
