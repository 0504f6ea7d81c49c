"""Build a backend group's tokenizer and incremental tokenizer from its ``TokenizerConfig``."""

from __future__ import annotations

from concurrent.futures import Executor

import aiohttp

from tokenization.base import Tokenizer
from tokenization.block_hash import DEFAULT_BLOCK_SIZE, make_hasher
from tokenization.config import TokenizerConfig, resolve_hash_algo
from tokenization.prompt import IncrementalTokenizer


def build_tokenizer(
    config: TokenizerConfig,
    *,
    client: aiohttp.ClientSession | None = None,
    base_url: str | None = None,
    model: str | None = None,
) -> Tokenizer:
    """The configured ``Tokenizer``. ``backend`` needs ``client`` and the rank's ``base_url``; ``auto``
    is the embedded tokenizer here (the gateway resolves it first: ``tokenization.discover``)."""
    if config.kind in ("tiktoken", "auto"):
        from tokenization.tiktoken_tokenizer import TiktokenTokenizer

        return TiktokenTokenizer(config.shared_cache_bytes)
    if config.kind == "hf":
        if config.path is None:
            raise ValueError("tokenization.kind 'hf' needs 'path' (a model directory with tokenizer.json)")
        from tokenization.hf_tokenizer import HfTokenizer

        return HfTokenizer(config.path, config.chat_template)
    if client is None or base_url is None:
        raise ValueError("tokenization.kind 'backend' needs an HTTP client and the rank's base URL")
    from tokenization.backend_tokenizer import BackendTokenizer

    return BackendTokenizer(
        client,
        base_url,
        model,
        cache_entries=config.backend_cache_entries,
        timeout_s=config.backend_timeout_s,
    )


def build_incremental(
    config: TokenizerConfig,
    *,
    block_size: int | None = None,
    tokenizer: Tokenizer | None = None,
    client: aiohttp.ClientSession | None = None,
    base_url: str | None = None,
    model: str | None = None,
    compare_with_rank: bool = False,
    executor: Executor | None = None,
) -> IncrementalTokenizer:
    """An ``IncrementalTokenizer`` for one backend group.

    Block size: ``config.block_size``, else ``block_size`` (learned from the backend's
    ``vllm:cache_config_info``), else 16. Hash algorithm: ``resolve_hash_algo`` (``auto``: xxh3, or
    vLLM's sha256 when ``compare_with_rank``). ``executor``: where large uncached work runs (see
    ``IncrementalTokenizer``).
    """
    size = config.block_size or block_size or DEFAULT_BLOCK_SIZE
    algo = resolve_hash_algo(config.hash_algo, compare_with_rank=compare_with_rank)
    hasher = make_hasher(algo, size, config.hash_seed, config.cache_salt_style)
    tok = tokenizer or build_tokenizer(config, client=client, base_url=base_url, model=model)
    return IncrementalTokenizer(
        tok,
        hasher,
        cache_bytes=config.session_cache_bytes,
        offload_tokens=config.offload_tokens,
        shared_cache_bytes=config.shared_cache_bytes,
        executor=executor,
    )
