"""``--record FILE``: the simulated rank appends every POST request it gets to a JSONL file.

One line per request: ``{"time", "path", "headers", "body"}`` (``body`` parsed when it is JSON, else
the text). The real-agent tier (``tests/agents/``) reads what each agent CLI really sent from it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class RecordRequests:
    """ASGI middleware: each POST request's path, headers and body appended to ``path``."""

    def __init__(self, app: ASGIApp, path: str) -> None:
        self.app = app
        self.path = path
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        parts: list[bytes] = []
        written = False

        async def tee() -> Message:
            nonlocal written
            message = await receive()
            if message["type"] == "http.request":
                parts.append(message.get("body", b""))
                if not message.get("more_body", False) and not written:
                    written = True
                    self._write(scope, b"".join(parts))
            return message

        await self.app(scope, tee, send)

    def _write(self, scope: Scope, raw: bytes) -> None:
        body: Any
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            body = raw.decode("utf-8", "replace")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        line = orjson.dumps({"time": time.time(), "path": scope["path"], "headers": headers, "body": body})
        with self._lock, open(self.path, "ab") as out:
            out.write(line + b"\n")
