"""Fixtures for routing tests: request contexts, pools, prompts (``redis_server`` is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Collection

from starlette.datastructures import Headers

from proxy.apis import CHAT
from proxy.apis.base import Usage
from proxy.context import Outcome, RequestContext
from proxy.stages.route import Router
from routing.ranks import Fleet, Rank
from tests.helpers.redis_server import RedisServer  # noqa: F401  (imported from here by the tests)


def make_ctx(
    session: str | None = None, hashes: list[bytes] | None = None, prompt_tokens: int | None = None
) -> RequestContext:
    hashes = hashes or []
    return RequestContext(
        api=CHAT,
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


def pick(router: Router, ctx: RequestContext, tried: Collection[str] = ()) -> Rank:
    """What the pipeline and forwarding do: route ``ctx`` (its plan's first rank); with ``tried``,
    the retry: the plan's next rank not tried yet, the request placed there."""
    if ctx.plan is None or not tried:
        ctx.plan = router.plan(ctx)
        return ctx.plan.ranks[0]
    rank = next(r for r in ctx.plan.ranks if r.name not in tried)
    router.placed(ctx, rank)
    return rank


def observe(router: Router, ctx: RequestContext, rank: Rank, cached_tokens: int | None) -> None:
    """The rank answered, reporting ``cached_tokens`` (None: it did not say)."""
    usage = Usage(ctx.prompt_tokens or 0, 0, cached_tokens) if cached_tokens is not None else None
    router.finished(Outcome(ctx, rank.name, 200, usage))
