"""Block hashes against the vLLM vectors in ../shared/specs/vllm_hash_vectors.json, every case."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenization.block_hash import (
    SHA256_INT,
    XXH3,
    ExtraKeysStyle,
    Xxh3ChainHasher,
    kv_event_hash,
    make_hasher,
)

VECTORS = Path(__file__).resolve().parents[3] / "shared" / "specs" / "vllm_hash_vectors.json"

if not VECTORS.exists():  # pragma: no cover - the shared folder is part of this machine
    pytest.skip(f"vLLM hash vectors not found at {VECTORS}", allow_module_level=True)

DATA: dict[str, Any] = json.loads(VECTORS.read_text())
A = list(range(64))
SEQUENCES: dict[str, tuple[list[int], str | None]] = {
    "A_tokens_0_63": (A, None),
    "B_tokens_0_63_with_idx17_changed_to_1000": ([*A[:17], 1000, *A[18:]], None),
    "C_tokens_0_39": (list(range(40)), None),
    "D_tokens_0_63_cache_salt_s3cr3t": (A, "s3cr3t"),
}


def _hasher_for(case: dict[str, Any]):
    algo = case["algo"].split()[0]
    if case["vllm"] == "0.8.5":
        algo = SHA256_INT
    style = ExtraKeysStyle.PLAIN if case["vllm"] == "0.11.0" else ExtraKeysStyle.TAGGED
    return make_hasher(algo, DATA["block_size"], case["none_hash_seed"], style)


@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_vector_case(name: str) -> None:
    case = DATA["cases"][name]
    hasher = _hasher_for(case)
    assert hasher.none_hash.hex() == case["NONE_HASH"]
    assert set(case["sequences"]) <= set(SEQUENCES)
    for seq_name, expected in case["sequences"].items():
        tokens, salt = SEQUENCES[seq_name]
        got = hasher.hash_blocks(tokens, cache_salt=salt)
        assert [h.hex() for h in got] == expected, seq_name
        u64 = case.get("kv_event_block_hashes_u64", {}).get(seq_name)
        if u64 is not None:
            assert [kv_event_hash(h) for h in got] == u64, seq_name


@pytest.mark.parametrize("name", sorted(DATA["cases"]))
def test_vector_case_continued_from_a_cached_parent(name: str) -> None:
    """Incremental hashing: blocks 2.. chained from block 1's hash equal the full chain."""
    hasher = _hasher_for(DATA["cases"][name])
    full = hasher.hash_blocks(A)
    assert hasher.hash_blocks(A, start_block=2, parent=full[1]) == full[2:]


def test_unset_seed_uses_vllm_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    case = DATA["cases"]["v0.33.0/sha256/PYTHONHASHSEED unset"]
    assert make_hasher("sha256", 16).none_hash.hex() == case["NONE_HASH"]


def test_sha256_int_rejects_cache_salt() -> None:
    with pytest.raises(ValueError, match="cache_salt"):
        make_hasher(SHA256_INT, 16, "0").hash_blocks(A, cache_salt="x")


class TestXxh3Chain:
    def test_chain_properties(self) -> None:
        hasher = make_hasher(XXH3, 16, "0")
        assert isinstance(hasher, Xxh3ChainHasher)
        full = hasher.hash_blocks(A)
        assert len(full) == 4 and len(set(full)) == 4 and all(len(h) == 16 for h in full)
        assert hasher.hash_blocks(list(range(40))) == full[:2]  # partial tail not hashed
        changed = hasher.hash_blocks([*A[:17], 1000, *A[18:]])
        assert changed[0] == full[0] and all(a != b for a, b in zip(changed[1:], full[1:], strict=True))
        salted = hasher.hash_blocks(A, cache_salt="s3cr3t")
        assert all(a != b for a, b in zip(salted, full, strict=True))
        assert hasher.hash_blocks(A, start_block=3, parent=full[2]) == full[3:]

    def test_array_and_list_inputs_agree(self) -> None:
        from array import array

        hasher = make_hasher(XXH3, 16, "0")
        big = [t * 7919 % 100_000 for t in range(1000)]
        assert hasher.hash_blocks(array("I", big)) == hasher.hash_blocks(big)
        assert make_hasher(XXH3, 16, "1").hash_blocks(big) != hasher.hash_blocks(big)


def test_auto_hash_algo_is_vllm_s_only_where_compared_with_a_rank() -> None:
    from tokenization.config import TokenizerConfig, resolve_hash_algo

    assert TokenizerConfig().hash_algo == "auto"
    assert resolve_hash_algo("auto", compare_with_rank=False) == "xxh3"
    assert resolve_hash_algo("auto", compare_with_rank=True) == "sha256"
    assert resolve_hash_algo("sha256_cbor", compare_with_rank=False) == "sha256_cbor", "a choice stands"
