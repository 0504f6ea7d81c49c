"""vLLM-compatible chained block hashes.

vLLM caches KV blocks under ``hash_i = H((hash_{i-1}, tuple(tokens_i), extra_keys_i))`` with
``hash_{-1} = NONE_HASH = H(seed)``. Reproducing it bit for bit lets prefixgate predict which
blocks a rank holds and read the hashes a rank publishes in its KV events. The vectors in
``shared/specs/vllm_hash_vectors.json`` (vLLM 0.11 and 0.33) pin this module down.

Only full blocks are hashed: a trailing partial block can never be a cache hit.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any

import cbor2
import xxhash

BlockHash = bytes
HashFunction = Callable[[Any], bytes]

#: The seed vLLM 0.33 uses for NONE_HASH when PYTHONHASHSEED is unset (sha256 variants only).
#: Tokens per KV block when neither the settings nor the rank say (vLLM's CUDA default).
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


class HashAlgo(StrEnum):
    """The values of vLLM's ``--prefix-caching-hash-algo``."""

    SHA256 = "sha256"
    SHA256_CBOR = "sha256_cbor"
    XXHASH = "xxhash"
    XXHASH_CBOR = "xxhash_cbor"


class ExtraKeysStyle(StrEnum):
    """How a vLLM version puts ``cache_salt`` into block 0's extra keys."""

    TAGGED = "tagged"  # 0.33: (("cache_salt", salt),)
    PLAIN = "plain"  # 0.11: (salt,)


def _pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


def _cbor(obj: Any) -> bytes:
    return cbor2.dumps(obj, canonical=True)


def hash_function(algo: HashAlgo | str) -> HashFunction:
    """The function vLLM applies to ``(parent, tokens, extra_keys)`` for ``algo``."""
    algo = HashAlgo(algo)
    serialize = _cbor if algo in (HashAlgo.SHA256_CBOR, HashAlgo.XXHASH_CBOR) else _pickle
    if algo in (HashAlgo.XXHASH, HashAlgo.XXHASH_CBOR):
        digest = xxhash.xxh3_128_digest
        return lambda obj: digest(serialize(obj))
    sha256 = hashlib.sha256
    return lambda obj: sha256(serialize(obj)).digest()


def none_hash_seed(environ: dict[str, str] | None = None) -> str:
    """The seed string vLLM 0.33 hashes into NONE_HASH: PYTHONHASHSEED if set, else its default.

    vLLM 0.11 (and 0.33 with xxhash) use random bytes when PYTHONHASHSEED is unset, which no proxy
    can reproduce: run such ranks with PYTHONHASHSEED set.
    """
    env = os.environ if environ is None else environ
    return env.get("PYTHONHASHSEED", DEFAULT_NONE_HASH_SEED)


def none_hash(algo: HashAlgo | str, seed: str) -> BlockHash:
    """NONE_HASH, the parent of block 0."""
    return hash_function(algo)(seed)


def cache_salt_extra_keys(
    salt: str | None, style: ExtraKeysStyle = ExtraKeysStyle.TAGGED
) -> tuple[Any, ...] | None:
    """Block 0's extra keys for a request carrying ``cache_salt`` (None when there is no salt)."""
    if salt is None:
        return None
    return (("cache_salt", salt),) if style is ExtraKeysStyle.TAGGED else (salt,)


def check_block_size(block_size: int) -> None:
    """Raise ``ValueError`` unless ``block_size`` is a positive token count."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


def chain_parent(none_hash: BlockHash, start_block: int, parent: BlockHash | None) -> BlockHash:
    """The parent hash that block ``start_block`` chains from: NONE_HASH for block 0, else ``parent``
    (required)."""
    if start_block == 0:
        return none_hash
    if parent is None:
        raise ValueError("parent is required when start_block > 0")
    return parent


class BlockHasher:
    """Hashes token sequences into vLLM's chained block hashes for one rank configuration.

    Stateless apart from its configuration; ``hash_blocks`` can continue a chain from any parent,
    which is what incremental per-session hashing needs.
    """

    __slots__ = ("_hash", "algo", "block_size", "extra_keys_style", "none_hash", "seed")

    def __init__(
        self,
        block_size: int,
        algo: HashAlgo | str = HashAlgo.SHA256,
        seed: str | None = None,
        extra_keys_style: ExtraKeysStyle = ExtraKeysStyle.TAGGED,
    ) -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self.algo = HashAlgo(algo)
        self.seed = none_hash_seed() if seed is None else seed
        self._hash = hash_function(self.algo)
        self.none_hash = self._hash(self.seed)
        self.extra_keys_style = extra_keys_style

    def hash_blocks(
        self,
        tokens: Sequence[int],
        *,
        start_block: int = 0,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``tokens`` from block ``start_block`` on.

        ``parent`` is the hash of block ``start_block - 1`` (ignored for block 0, whose parent is
        NONE_HASH). ``cache_salt`` only affects block 0.
        """
        size = self.block_size
        h = self._hash
        n_full = len(tokens) // size
        parent = chain_parent(self.none_hash, start_block, parent)
        out: list[BlockHash] = []
        append = out.append
        salt_keys = cache_salt_extra_keys(cache_salt, self.extra_keys_style)
        for i in range(start_block, n_full):
            extra = salt_keys if i == 0 else None
            parent = h((parent, tuple(tokens[i * size : (i + 1) * size]), extra))
            append(parent)
        return out


def kv_event_hash(block_hash: BlockHash) -> int:
    """The uint64 vLLM publishes for a block in KV events: the digest's last 8 bytes, big-endian."""
    return int.from_bytes(block_hash[-8:], "big")
