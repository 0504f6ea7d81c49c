"""Ask the rank: ``POST /tokenize`` returns the exact ids for any model, at one round trip per new request.

Answers are cached by a hash of the request's content (LRU), so retries and repeated prompts cost no
round trip. Block hashes still reuse the session's previous turn through the common token prefix.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

import aiohttp
import orjson
import xxhash

from tokenization.base import ChatPrompt, Encoded, Plan, token_ids_plan
from tokenization.lru import LRU

JSON_HEADERS = {"content-type": "application/json"}


class BackendTokenizeError(RuntimeError):
    """The backend's ``/tokenize`` failed or answered something unexpected."""


class BackendTokenizer:
    """Tokenizes through a vLLM-compatible rank's ``POST {base_url}/tokenize``.

    ``client`` is owned by the caller (shared connection pool); ``model`` is sent when the request
    names none.
    """

    kind = "backend"

    def __init__(
        self,
        client: aiohttp.ClientSession,
        base_url: str,
        model: str | None = None,
        *,
        cache_entries: int = 1024,
        timeout_s: float = 10.0,
    ) -> None:
        self._client = client
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model
        self._timeout = timeout_s
        # Bounded by entry count: each answer costs 1 of a budget of ``cache_entries``.
        self._cache = LRU[int, array](cache_entries)
        self.round_trips = 0

    async def tokenize(self, payload: Mapping[str, Any]) -> array:
        """Token ids for a ``/tokenize`` payload, from the cache or the backend."""
        raw = orjson.dumps(payload)
        key = xxhash.xxh3_128_intdigest(raw)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        self.round_trips += 1
        try:
            async with self._client.post(
                self._url, data=raw, headers=JSON_HEADERS, timeout=aiohttp.ClientTimeout(total=self._timeout)
            ) as response:
                content = await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BackendTokenizeError(f"{self._url}: {exc!r}") from exc
        if response.status != 200:
            text = content[:200].decode(errors="replace")
            raise BackendTokenizeError(f"{self._url}: HTTP {response.status}: {text}")
        try:
            ids = orjson.loads(content)["tokens"]
            tokens = array("I", ids)
        except (orjson.JSONDecodeError, KeyError, TypeError, OverflowError) as exc:
            raise BackendTokenizeError(f"{self._url}: unexpected answer: {exc!r}") from exc
        self._cache.put(key, tokens, 1)
        return tokens

    def _model_for(self, model: str | None) -> str | None:
        return model or self._model

    async def plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        """One round trip (unless cached); the plan is ready, reuse = common prefix with ``prev``."""
        payload: dict[str, Any] = {
            "model": self._model_for(prompt.model),
            "messages": prompt.messages,
            "add_generation_prompt": prompt.add_generation_prompt,
        }
        if prompt.tools:
            payload["tools"] = prompt.tools
        if prompt.chat_template_kwargs:
            payload["chat_template_kwargs"] = prompt.chat_template_kwargs
        return token_ids_plan(await self.tokenize(payload), prev)

    def prepare_thread(self) -> None:
        """Nothing is kept per thread."""

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None = None) -> Plan:
        """A completion prompt through ``{model, prompt}`` (the rank adds its special tokens)."""
        return token_ids_plan(await self.tokenize({"model": self._model_for(model), "prompt": text}), prev)
