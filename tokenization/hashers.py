"""Block hashers beyond vLLM 0.11+/0.33's: the fast internal xxh3 chain and vLLM 0.8.5's int sha256.

Every hasher has the ``BlockHasher`` shape (``block_size``, ``none_hash``, ``hash_blocks``), so the
incremental tokenizer can continue any chain from a cached parent. ``make_hasher`` picks one by name.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Sequence
from typing import Protocol

import xxhash

from tokenization.block_hash import (
    BlockHash,
    BlockHasher,
    ExtraKeysStyle,
    HashAlgo,
    chain_parent,
    check_block_size,
    none_hash,
    none_hash_seed,
)

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
