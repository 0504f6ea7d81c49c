"""Markers for the test tiers that need what the default run does not have (real vLLM, agent CLIs)."""

from __future__ import annotations

from pathlib import Path

import pytest


def mark_folder(items: list[pytest.Item], folder: Path, marker: pytest.MarkDecorator) -> None:
    """Add ``marker`` to every collected test below ``folder`` (the tier's conftest calls this)."""
    for item in items:
        if folder in Path(str(item.fspath)).parents:
            item.add_marker(marker)
