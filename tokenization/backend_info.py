"""What a rank says about its cache layout: ``vllm:cache_config_info`` in ``GET /metrics``."""

from __future__ import annotations

import re

import aiohttp

_INFO_LINE = re.compile(r"^vllm:cache_config_info\{(?P<labels>.*)\}\s+\S+\s*$", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_cache_config_info(metrics_text: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (``block_size``, ``prefix_caching_hash_algo``, ...);
    empty when the metric is absent."""
    match = _INFO_LINE.search(metrics_text)
    if match is None:
        return {}
    return {k: v.replace('\\"', '"').replace("\\\\", "\\") for k, v in _LABEL.findall(match.group("labels"))}


def block_size_of(info: dict[str, str]) -> int | None:
    """The rank's block size from ``parse_cache_config_info``'s answer, if it gives one."""
    value = info.get("block_size", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


async def fetch_cache_config(
    client: aiohttp.ClientSession, base_url: str, timeout_s: float = 5.0
) -> dict[str, str]:
    """``GET {base_url}/metrics`` and parse ``vllm:cache_config_info``."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with client.get(base_url.rstrip("/") + "/metrics", timeout=timeout) as response:
        response.raise_for_status()
        return parse_cache_config_info(await response.text())
