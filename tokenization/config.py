"""``tokenization:`` section of prefixgate's YAML config (top level, or per backend group)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenization.block_hash import ExtraKeysStyle
from tokenization.hashers import HASH_ALGOS


class TokenizerConfig(BaseModel):
    """How to turn a request into the rank's tokens and block hashes."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["tiktoken", "hf", "backend"] = Field(
        default="tiktoken",
        description="tiktoken: embedded cl100k + ChatML (exact for the simulated ranks); hf: a local "
        "model dir's tokenizer.json + chat template; backend: the rank's POST /tokenize",
    )
    path: Path | None = Field(default=None, description="hf: model directory (tokenizer.json, template)")
    chat_template: Path | None = Field(
        default=None, description="hf: template file overriding the model dir's"
    )
    block_size: int | None = Field(default=None, gt=0, description="None: learn from vllm:cache_config_info")
    hash_algo: str = Field(
        default="sha256",
        description="vLLM's sha256 | sha256_cbor | xxhash | xxhash_cbor, sha256_int (vLLM 0.8.5), "
        "or xxh3 (fast, internal index keys only: not comparable with a rank's hashes)",
    )
    hash_seed: str | None = Field(default=None, description="None: PYTHONHASHSEED, else 'vllm-none-hash'")
    cache_salt_style: ExtraKeysStyle = Field(
        default=ExtraKeysStyle.TAGGED, description="tagged: vLLM >= 0.12 style; plain: vLLM 0.11"
    )
    session_cache_mb: float = Field(default=256.0, ge=0, description="memory budget of the per-session cache")
    shared_cache_mb: float = Field(
        default=32.0,
        ge=0,
        description="memory budget of each cross-session cache of shared leading segments (system "
        "prompt + tools: their token ids, and their block hashes)",
    )
    offload_tokens: int = Field(
        default=8192, ge=0, description="uncached work above this many (estimated) tokens runs in a thread"
    )
    backend_cache_entries: int = Field(default=1024, ge=0, description="backend: /tokenize answers kept")
    backend_timeout_s: float = Field(default=10.0, gt=0)

    @field_validator("hash_algo")
    @classmethod
    def _known_algo(cls, value: str) -> str:
        if value not in HASH_ALGOS:
            raise ValueError(f"hash_algo must be one of {', '.join(HASH_ALGOS)}, got {value!r}")
        return value

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
