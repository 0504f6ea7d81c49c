"""With no tokenizer configured (``tokenization: {kind: auto}``, the default), find the served model's.

Estimates in another model's tokens run high or low by several percent and every other request
corrects the index, so prefixgate looks for the rank's own tokens, in order:

1. the model's files: ``/v1/models`` names the served model by ``id`` and ``root`` (vLLM's ``root``
   is the path or repository it loaded); a local directory with a ``tokenizer.json``, or that
   repository in the Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
   ``~/.cache/huggingface/hub``), gives the ``hf`` tokenizer and the model's chat template, checked
   against the rank's ``/tokenize`` when it answers (a mismatch, say a template the rank overrides,
   falls through to the next step);
2. the rank's ``POST /tokenize`` with messages and tools: when the embedded tokenizer (cl100k +
   ChatML, the simulated ranks') gives the same ids on probe requests it is used (no round trips),
   else ``backend`` (exact for any model, one round trip per new request);
3. else the embedded tokenizer, with a warning: its estimates are approximate for other models.

``discover`` says which was chosen and why in ``Discovery.reason``: the gateway logs it in one line.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tokenization.base import ChatPrompt, Tokenizer
from tokenization.config import TokenizerConfig

log = logging.getLogger("prefixgate.tokenization")

#: Chat requests whose ids must agree with the rank's ``/tokenize`` for a local tokenizer to be used.
PROBES: tuple[dict[str, Any], ...] = (
    {
        "messages": [
            {"role": "system", "content": "You are a probe of prefixgate. Answer briefly.\n"},
            {"role": "user", "content": "List the files, then run `pytest -q` and report."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "run_shell",
                    "description": "Runs a shell command.",
                    "parameters": {
                        "type": "object",
                        "properties": {"command": {"type": "string", "description": "the command"}},
                        "required": ["command"],
                    },
                },
            }
        ],
    },
    {
        "messages": [
            {"role": "user", "content": "Héllo — 你好, naïve café: ½ + ¼ = ¾?"},
            {"role": "assistant", "content": "Yes: 0.75."},
            {"role": "user", "content": "And   spaced\ttabs\n\nnewlines?"},
        ]
    },
)


@dataclass(frozen=True, slots=True)
class Discovery:
    """The tokenizer settings to use, and the sentence saying why (``warn``: only approximate)."""

    config: TokenizerConfig
    reason: str
    warn: bool = False
    #: The served model's id (``/v1/models``): what ``backend`` asks the rank to tokenize for when a
    #: request names another model.
    model: str | None = None


def hub_caches(environ: dict[str, str] | None = None) -> list[Path]:
    """Where Hugging Face keeps downloaded repositories, as its libraries look for them."""
    env = os.environ if environ is None else environ
    found: list[Path] = []
    if env.get("HF_HUB_CACHE"):
        found.append(Path(env["HF_HUB_CACHE"]))
    if env.get("HF_HOME"):
        found.append(Path(env["HF_HOME"]) / "hub")
    found.append(Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface" / "hub")
    return found


def model_directory(name: str, caches: Sequence[Path]) -> Path | None:
    """A local directory holding ``name``'s ``tokenizer.json``: the path itself, or its newest
    snapshot in a Hugging Face cache (``name`` = ``org/repo``)."""
    path = Path(name).expanduser()
    if path.is_absolute() or name.startswith("."):
        return path if (path / "tokenizer.json").is_file() else None
    if name.count("/") != 1:
        return None
    repo = "models--" + name.replace("/", "--")
    for cache in caches:
        snapshots = cache / repo / "snapshots"
        if not snapshots.is_dir():
            continue
        candidates = [d for d in snapshots.iterdir() if (d / "tokenizer.json").is_file()]
        if candidates:
            return max(candidates, key=lambda d: d.stat().st_mtime)
    return None


async def _json(
    client: aiohttp.ClientSession, method: str, url: str, timeout: float, body: Any = None
) -> Any:
    """The JSON a 200 answer carries, None for any other status; raises ``aiohttp.ClientError``,
    ``TimeoutError`` or ``ValueError`` (not JSON)."""
    data = None if body is None else orjson.dumps(body)
    headers = None if body is None else {"content-type": "application/json"}
    limit = aiohttp.ClientTimeout(total=timeout)
    async with client.request(method, url, data=data, headers=headers, timeout=limit) as response:
        return orjson.loads(await response.read()) if response.status == 200 else None


async def _models(client: aiohttp.ClientSession, url: str, timeout: float) -> list[dict[str, Any]]:
    try:
        data = await _json(client, "GET", f"{url}/v1/models", timeout)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return []
    cards = data.get("data") if isinstance(data, dict) else None
    return [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []


async def _rank_ids(
    client: aiohttp.ClientSession, url: str, model: str | None, timeout: float
) -> list[list[int]] | None:
    """The rank's token ids for each probe (None: its ``/tokenize`` does not answer them)."""
    out: list[list[int]] = []
    for probe in PROBES:
        body = {**probe, "add_generation_prompt": True, **({"model": model} if model else {})}
        try:
            answer = await _json(client, "POST", f"{url}/tokenize", timeout, body)
            tokens = answer.get("tokens") if answer is not None else None
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None
        if not isinstance(tokens, list):
            return None
        out.append(tokens)
    return out


async def _agrees(tokenizer: Tokenizer, expected: list[list[int]]) -> bool:
    for probe, ids in zip(PROBES, expected, strict=True):
        plan = await tokenizer.plan_chat(ChatPrompt(probe["messages"], probe.get("tools")), None)
        if list(plan.finish().tokens) != ids:
            return False
    return True


def _hf(path: Path) -> Tokenizer | None:
    try:
        from tokenization.hf_tokenizer import HfTokenizer
    except ImportError:  # the hf extra (tokenizers, jinja2) is not installed
        return None
    try:
        return HfTokenizer(path)
    except (OSError, ValueError) as exc:
        log.warning("cannot load the tokenizer of %s: %s", path, exc)
        return None


async def discover(
    config: TokenizerConfig,
    client: aiohttp.ClientSession,
    url: str | None,
    *,
    timeout: float = 5.0,
    caches: Sequence[Path] | None = None,
) -> Discovery:
    """The tokenizer for the model served at ``url`` (see the module docstring); ``config`` is the
    configured section (``kind: auto``), whose other settings are kept."""
    embedded = config.model_copy(update={"kind": "tiktoken"})
    if url is None:
        return Discovery(embedded, "no healthy rank to ask: the embedded cl100k + ChatML tokenizer", True)
    cards = await _models(client, url, timeout)
    model = cards[0].get("id") if cards and isinstance(cards[0].get("id"), str) else None
    expected = await _rank_ids(client, url, model, timeout)
    names = [n for c in cards[:1] for n in (c.get("root"), c.get("id")) if isinstance(n, str) and n]
    for name in dict.fromkeys(names):
        path = model_directory(name, hub_caches() if caches is None else caches)
        # loading a tokenizer takes a second or more: off the event loop, which may be serving
        tokenizer = await asyncio.to_thread(_hf, path) if path is not None else None
        if path is None or tokenizer is None:
            continue
        if expected is not None and not await _agrees(tokenizer, expected):
            log.warning("the tokenizer files of %s (%s) disagree with the rank's /tokenize", name, path)
            continue
        checked = "checked against the rank's /tokenize" if expected is not None else "not checked"
        return Discovery(
            config.model_copy(update={"kind": "hf", "path": path}),
            f"the served model's own tokenizer and chat template from {path} (/v1/models: {name}; {checked})",
        )
    if expected is not None:
        from tokenization.tiktoken_tokenizer import TiktokenTokenizer

        if await _agrees(TiktokenTokenizer(), expected):
            return Discovery(
                embedded, "the embedded cl100k + ChatML tokenizer: it agrees with the rank's /tokenize"
            )
        return Discovery(
            config.model_copy(update={"kind": "backend"}),
            f"the rank's POST /tokenize (model {model or '?'}: no local tokenizer files found)",
            model=model,
        )
    return Discovery(
        embedded,
        f"the embedded cl100k + ChatML tokenizer: no tokenizer files for {model or 'the served model'} and "
        "no /tokenize on the rank, so estimates are approximate; set tokenization: {kind: hf, path: ...}",
        True,
    )
