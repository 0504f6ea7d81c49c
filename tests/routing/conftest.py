"""Fixtures for routing tests: request contexts, pools, prompts (``redis_server`` is in tests/conftest.py)."""

from __future__ import annotations

from starlette.datastructures import Headers

from proxy.context import ApiKind, RequestContext
from routing.ranks import Fleet, Rank
from tests.helpers.redis_server import RedisServer  # noqa: F401  (imported from here by the tests)


def make_ctx(
    session: str | None = None, hashes: list[bytes] | None = None, prompt_tokens: int | None = None
) -> RequestContext:
    hashes = hashes or []
    return RequestContext(
        api=ApiKind.CHAT,
        headers=Headers({}),
        raw_body=b"{}",
        body={},
        stream=False,
        model="m",
        started=0.0,
        session_key=session,
        prompt_tokens=prompt_tokens if prompt_tokens is not None else len(hashes) * 16 + 5,
        block_hashes=hashes,
    )


def make_pool(n: int = 4, pool_tokens: int | None = None, block_size: int = 16) -> Fleet:
    return Fleet(
        Rank(name=f"r{i}", url=f"http://127.0.0.1:{i + 1}", pool_tokens=pool_tokens, block_size=block_size)
        for i in range(n)
    )


def chain(tag: str, n: int, parent: bytes = b"") -> list[bytes]:
    """``n`` fake chained 32-byte hashes; the same (parent, tag) gives the same chain."""
    import hashlib

    out: list[bytes] = []
    prev = parent
    for i in range(n):
        prev = hashlib.sha256(prev + f"{tag}:{i}".encode()).digest()
        out.append(prev)
    return out
