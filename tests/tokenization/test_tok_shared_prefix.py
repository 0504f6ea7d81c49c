"""The cross-session cache of shared leading segments: same blocks as without it, less work."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tokenization.block_hash import make_hasher
from tokenization.lru import LRU
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer

SYSTEM = "You are a coding agent. Follow the repository's conventions.\n" * 20
TOOLS = [
    {
        "type": "function",
        "function": {"name": f"tool_{i}", "description": "does thing " * i, "parameters": {}},
    }
    for i in range(12)
]


def _body(user: str, *, salt: str | None = None, system: str = SYSTEM) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "tools": TOOLS,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _fresh(algo: str = "sha256") -> IncrementalTokenizer:
    return IncrementalTokenizer(TiktokenTokenizer(), make_hasher(algo, 16, "0"))


def _blocks(inc: IncrementalTokenizer, session: str | None, body: dict[str, Any]) -> Any:
    return asyncio.run(inc.blocks_for_chat(session, body))


@pytest.mark.parametrize("algo", ["sha256", "xxh3"])
def test_new_sessions_reuse_the_shared_segment_with_identical_results(algo: str) -> None:
    inc = _fresh(algo)
    first = _blocks(inc, "s1", _body("fix test one"))
    assert first.shared_blocks == 0, "nothing cached yet"
    system_tokens = first.parts[0][2]
    assert first.parts[0][0] == "system+tools" and system_tokens > 32
    second = _blocks(inc, "s2", _body("fix test two, which is different"))
    assert second.shared_blocks == system_tokens // 16
    assert inc.shared.hits == 1 and inc.tokenizer.shared.hits == 1
    for body, got in ((_body("fix test one"), first), (_body("fix test two, which is different"), second)):
        reference = _blocks(_fresh(algo), None, body)  # a cold tokenizer: no cache of any kind
        assert list(got.tokens) == list(reference.tokens)
        assert list(got.block_hashes) == list(reference.block_hashes)
        assert got.parts == reference.parts


def test_salt_and_system_prompt_key_the_shared_hashes() -> None:
    inc = _fresh()
    _blocks(inc, "s1", _body("hello"))
    salted = _blocks(inc, "s2", _body("hello", salt="tenant"))
    assert salted.shared_blocks == 0, "another salt changes every block: not shared"
    assert list(salted.block_hashes) == list(
        _blocks(_fresh(), None, _body("hello", salt="tenant")).block_hashes
    )
    salted_again = _blocks(inc, "s3", _body("hello", salt="tenant"))
    assert salted_again.shared_blocks > 0
    other = _blocks(inc, "s4", _body("hello", system=SYSTEM + "Extra rule.\n"))
    assert other.shared_blocks == 0
    assert list(other.block_hashes) == list(
        _blocks(_fresh(), None, _body("hello", system=SYSTEM + "Extra rule.\n")).block_hashes
    )


def test_session_turns_keep_using_their_own_cache() -> None:
    inc = _fresh()
    _blocks(inc, "warm", _body("warm up"))
    body = _body("turn one")
    one = _blocks(inc, "s", body)
    body["messages"] += [{"role": "assistant", "content": "done"}, {"role": "user", "content": "turn two"}]
    two = _blocks(inc, "s", body)
    assert one.shared_blocks > 0 and two.shared_blocks == 0 and two.reused_blocks >= one.shared_blocks
    assert list(two.block_hashes) == list(_blocks(_fresh(), None, body).block_hashes)


def test_cache_is_bounded_by_bytes_lru_first() -> None:
    cache: LRU[str, str] = LRU(budget_bytes=100)
    cache.put("a", "A", 40)
    cache.put("b", "B", 40)
    assert cache.get("a") == "A"  # now b is the least recently used
    cache.put("c", "C", 40)
    assert cache.get("b") is None and cache.get("a") == "A" and cache.get("c") == "C"
    assert cache.nbytes == 80 and cache.evictions == 1
    cache.put("huge", "H", 101)  # larger than the budget: not kept, nothing flushed
    assert cache.get("huge") is None and len(cache) == 2
    cache.put("a", "A2", 10)  # replacing an entry re-counts its bytes
    assert cache.nbytes == 50 and cache.get("a") == "A2"


def test_zero_budget_disables_sharing_without_changing_results() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(0), make_hasher("sha256", 16, "0"), shared_cache_bytes=0)
    _blocks(inc, "s1", _body("one"))
    two = _blocks(inc, "s2", _body("two"))
    assert two.shared_blocks == 0 and len(inc.shared) == 0 and len(inc.tokenizer.shared) == 0
    assert list(two.block_hashes) == list(_blocks(_fresh(), None, _body("two")).block_hashes)
