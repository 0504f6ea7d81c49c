"""``tokenization:`` section of prefixgate's YAML config (top level, or per backend group)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenization.block_hash import HASH_ALGOS, XXH3, ExtraKeysStyle, HashAlgo

#: ``hash_algo`` default: vLLM's own hashes only where something compares them with a rank's.
AUTO_HASH_ALGO = "auto"


def resolve_hash_algo(configured: str, *, compare_with_rank: bool) -> str:
    """The block hash algorithm to run for ``configured`` (``auto`` or a concrete name).

    The proxy never needs vLLM's hashes: its index keys are its own, and the KV-event mirror re-hashes
    each stored block's token ids with the proxy's hasher (``routing.kv_events.RankMirror``). So
    ``auto`` is the fast xxh3 chain there (an appended 2k-token turn hashes in ~0.06 ms instead of
    ~0.4 ms with sha256; a 100k-token first turn in ~1.5 ms instead of ~18 ms), and vLLM's default
    sha256 where the point is comparing with a rank (``prefixgate tokenize``).
    """
    if configured != AUTO_HASH_ALGO:
        return configured
    return HashAlgo.SHA256.value if compare_with_rank else XXH3


class TokenizerConfig(BaseModel):
    """How to turn a request into the rank's tokens and block hashes."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["auto", "tiktoken", "hf", "backend"] = Field(
        default="auto",
        description="auto: find the served model's (tokenization.discover; standalone: tiktoken); "
        "tiktoken: embedded cl100k + ChatML (exact for the simulated ranks); hf: a local "
        "model dir's tokenizer.json + chat template; backend: the rank's POST /tokenize",
    )
    path: Path | None = Field(default=None, description="hf: model directory (tokenizer.json, template)")
    chat_template: Path | None = Field(
        default=None, description="hf: template file overriding the model dir's"
    )
    block_size: int | None = Field(default=None, gt=0, description="None: learn from vllm:cache_config_info")
    hash_algo: str = Field(
        default=AUTO_HASH_ALGO,
        description="auto: xxh3 in the proxy (its index keys are its own, KV events included), "
        "sha256 in `prefixgate tokenize`; or one of vLLM's sha256 | sha256_cbor | xxhash | xxhash_cbor, "
        "sha256_int (vLLM 0.8.5), or xxh3 (fast, not comparable with a rank's hashes)",
    )
    hash_seed: str | None = Field(default=None, description="None: PYTHONHASHSEED, else 'vllm-none-hash'")
    cache_salt_style: ExtraKeysStyle = Field(
        default=ExtraKeysStyle.TAGGED, description="tagged: vLLM >= 0.12 style; plain: vLLM 0.11"
    )
    session_cache_mb: float = Field(
        default=256.0,
        ge=0,
        description="memory budget of the standalone per-session cache "
        "(prefixgate serve keeps sessions under session_memory_mb)",
    )
    shared_cache_mb: float = Field(
        default=32.0,
        ge=0,
        description="memory budget of each cross-session cache of shared leading segments (system "
        "prompt + tools: their token ids, and their block hashes)",
    )
    offload_tokens: int = Field(
        default=8192, ge=0, description="uncached work above this many (estimated) tokens runs in a thread"
    )
    workers: int = Field(
        default=0,
        ge=0,
        description="threads that work runs in (prefixgate serve); 0: one per core (with tiktoken, up to "
        "8 of them keep an encoder of their own, ~20 MB each)",
    )
    backend_cache_entries: int = Field(default=1024, ge=0, description="backend: /tokenize answers kept")
    backend_timeout_s: float = Field(
        default=10.0, gt=0, description="backend: seconds a /tokenize call may take"
    )

    @field_validator("hash_algo")
    @classmethod
    def _known_algo(cls, value: str) -> str:
        if value != AUTO_HASH_ALGO and value not in HASH_ALGOS:
            raise ValueError(
                f"hash_algo must be {AUTO_HASH_ALGO} or one of {', '.join(HASH_ALGOS)}, got {value!r}"
            )
        return value

    @property
    def worker_threads(self) -> int:
        """``workers``, or one per core."""
        return self.workers or os.cpu_count() or 1

    @property
    def session_cache_bytes(self) -> int:
        return int(self.session_cache_mb * 1024 * 1024)

    @property
    def shared_cache_bytes(self) -> int:
        return int(self.shared_cache_mb * 1024 * 1024)


def load_tokenizer_config(path: str | Path | None) -> TokenizerConfig:
    """The ``tokenization:`` section of prefixgate's YAML config file (defaults when absent)."""
    if path is None:
        return TokenizerConfig()
    data: Any = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: top level must be a mapping")
    return TokenizerConfig.model_validate(data.get("tokenization") or {})
