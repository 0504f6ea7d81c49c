"""Fixtures of the real-vLLM tier: two vLLM CPU ranks serving the tiny model, prefixgate in front.

Every test here carries the ``vllm`` marker (deselected by default); run them with
``tests/vllm/test.sh`` or ``python -m pytest -m vllm -n 0 tests/vllm`` once
``tests/vllm/install.sh`` has built the vLLM virtualenv. The ranks start once per session
(about a minute) and are shared: tests keep apart by putting a fresh nonce in their prompts.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from proxy.server import ServerThread
from tests.helpers.gateway import start_gateway
from tests.helpers.markers import mark_folder
from tests.vllm.ranks import (
    ATTACH_ENV,
    HASH_SEED,
    VllmRank,
    attach_ranks,
    ensure_model,
    start_ranks,
    stop_ranks,
)
from tokenization.block_hash import BlockHasher
from tokenization.hf_tokenizer import HfTokenizer

BLOCK = 32


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).parent, pytest.mark.vllm)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return ensure_model()


@pytest.fixture(scope="session")
def ranks(model_dir: Path) -> Iterator[list[VllmRank]]:
    attach = os.environ.get(ATTACH_ENV)
    if attach:  # ranks kept running by ``python -m tests.vllm.ranks --state FILE``
        yield attach_ranks(Path(attach))
        return
    started = start_ranks(2, model_dir=model_dir)
    yield started
    stop_ranks(started)


@pytest.fixture(scope="session")
def tok(model_dir: Path) -> HfTokenizer:
    return HfTokenizer(model_dir)


@pytest.fixture(scope="session")
def hasher() -> BlockHasher:
    """prefixgate's prediction of the ranks' hashes: sha256, seed = the ranks' PYTHONHASHSEED."""
    return BlockHasher(BLOCK, "sha256", seed=HASH_SEED)


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client(trust_env=False, timeout=120.0) as c:
        yield c


@pytest.fixture
def nonce() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture
def gateway(ranks: list[VllmRank], model_dir: Path) -> Iterator[Callable[..., ServerThread]]:
    """Start prefixgate in front of both ranks with ``hf`` tokenization: ``gateway(kv_events=True)``;
    ``defaults=True``: no tokenization configured (prefixgate finds the served model's itself)."""
    started: list[ServerThread] = []

    def start(*, kv_events: bool = False, defaults: bool = False, **options: Any) -> ServerThread:
        options.setdefault("policy", "prefix_affinity")
        options.setdefault("health_interval", 1.0)
        options.setdefault("health_timeout", 5.0)
        if not defaults:
            options["tokenization"] = {"kind": "hf", "path": str(model_dir), "hash_seed": HASH_SEED}
        if kv_events:
            options["kv_events"] = ",".join(f"{r.name}={r.kv_endpoint}|{r.replay_endpoint}" for r in ranks)
        server = start_gateway(ranks, timeout=60.0, **options)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
