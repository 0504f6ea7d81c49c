"""vLLM-compatible chained block hashes.

vLLM caches KV blocks under ``hash_i = H((hash_{i-1}, tuple(tokens_i), extra_keys_i))`` with
``hash_{-1} = NONE_HASH = H(seed)``. Reproducing it bit for bit lets prefixgate predict which
blocks a rank holds and read the hashes a rank publishes in its KV events. The vectors in
``shared/specs/vllm_hash_vectors.json`` (vLLM 0.11 and 0.33) pin this module down.

Beyond vLLM 0.11+/0.33's algorithms: the fast internal xxh3 chain (index keys only) and vLLM 0.8.5's
int sha256. Every hasher has ``BlockHasher``'s shape (``block_size``, ``none_hash``, ``hash_blocks``),
so the incremental tokenizer can continue any chain from a cached parent; ``make_hasher`` picks one
by name.

Only full blocks are hashed: a trailing partial block can never be a cache hit.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from array import array
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, Protocol

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


#: Internal chain: xxh3-128 over (parent digest, block tokens as little-endian uint32). Not vLLM's.
XXH3 = "xxh3"
#: vLLM 0.8.5's ``sha256``: the digest as a Python int, chained as an int.
SHA256_INT = "sha256_int"

HASH_ALGOS: tuple[str, ...] = (*(a.value for a in HashAlgo), SHA256_INT, XXH3)


class ChainHasher(Protocol):
    """What the incremental tokenizer needs from a block hasher."""

    block_size: int
    none_hash: BlockHash

    @property
    def algo(self) -> str:
        """The name ``make_hasher`` takes (read-only: ``BlockHasher``'s is a ``HashAlgo``)."""
        ...

    def hash_blocks(
        self,
        tokens: Sequence[int],
        *,
        start_block: int = 0,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``tokens`` from ``start_block`` on (see ``BlockHasher``)."""
        ...


class Xxh3ChainHasher:
    """Chained xxh3-128 over raw token bytes: ~10x cheaper than pickle + sha256, for index keys only.

    ``h_i = xxh3_128(h_{i-1} || uint32le(tokens_i) [|| b"\\0salt:" + salt for block 0])`` with
    ``h_{-1} = xxh3_128(b"prefixgate-xxh3:" + seed)``. Blocks are fixed-length, so the salt suffix is
    unambiguous.
    """

    __slots__ = ("block_size", "none_hash", "seed")
    algo = XXH3

    def __init__(self, block_size: int, seed: str | None = None) -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self.seed = none_hash_seed() if seed is None else seed
        self.none_hash = xxhash.xxh3_128_digest(b"prefixgate-xxh3:" + self.seed.encode())

    def hash_blocks(
        self,
        tokens: Sequence[int],
        *,
        start_block: int = 0,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``tokens`` from block ``start_block`` on."""
        size = self.block_size
        n_full = len(tokens) // size
        if start_block >= n_full:
            return []
        parent = chain_parent(self.none_hash, start_block, parent)
        # One contiguous uint32 buffer, sliced zero-copy per block.
        if isinstance(tokens, array) and tokens.typecode == "I":
            buf = memoryview(tokens)[start_block * size : n_full * size].cast("B")
        else:
            buf = memoryview(array("I", tokens[start_block * size : n_full * size])).cast("B")
        step = size * 4
        new = xxhash.xxh3_128
        out: list[BlockHash] = []
        append = out.append
        for j in range(n_full - start_block):
            h = new(parent)
            h.update(buf[j * step : (j + 1) * step])
            if cache_salt is not None and start_block + j == 0:
                h.update(b"\0salt:" + cache_salt.encode())
            parent = h.digest()
            append(parent)
        return out


class IntSha256BlockHasher:
    """vLLM 0.8.5's non-default ``sha256``: ``int(sha256(pickle((parent_int, tokens, extra))))``.

    Hashes are returned as 32-byte big-endian digests, so they index like the other algorithms and
    ``kv_event_hash`` gives the same uint64. 0.8.5 took NONE_HASH from PYTHONHASHSEED (random when
    unset); cache_salt did not exist yet.
    """

    __slots__ = ("block_size", "none_hash", "seed")
    algo = SHA256_INT

    def __init__(self, block_size: int, seed: str | None = None) -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self.seed = none_hash_seed() if seed is None else seed
        # The same sha256-over-pickle as vLLM's later "sha256"; only the parent's form differs.
        self.none_hash = none_hash(HashAlgo.SHA256, self.seed)

    def hash_blocks(
        self,
        tokens: Sequence[int],
        *,
        start_block: int = 0,
        parent: BlockHash | None = None,
        cache_salt: str | None = None,
    ) -> list[BlockHash]:
        """Hashes of the full blocks of ``tokens`` from block ``start_block`` on."""
        if cache_salt is not None:
            raise ValueError("vLLM 0.8.5 has no cache_salt")
        size = self.block_size
        # sha256 and pickle inline, not hash_function(SHA256): its two extra calls cost ~4 % here.
        sha256, dumps, from_bytes = hashlib.sha256, pickle.dumps, int.from_bytes
        parent = chain_parent(self.none_hash, start_block, parent)
        out: list[BlockHash] = []
        append = out.append
        for i in range(start_block, len(tokens) // size):
            block = tuple(tokens[i * size : (i + 1) * size])
            parent = sha256(dumps((from_bytes(parent, "big"), block, None), protocol=5)).digest()
            append(parent)
        return out


def make_hasher(
    algo: str,
    block_size: int,
    seed: str | None = None,
    extra_keys_style: ExtraKeysStyle = ExtraKeysStyle.TAGGED,
) -> ChainHasher:
    """The hasher for ``algo`` (one of ``HASH_ALGOS``); ``seed`` None = PYTHONHASHSEED or vLLM's default."""
    if algo == XXH3:
        return Xxh3ChainHasher(block_size, seed)
    if algo == SHA256_INT:
        return IntSha256BlockHasher(block_size, seed)
    return BlockHasher(block_size, HashAlgo(algo), seed, extra_keys_style)
