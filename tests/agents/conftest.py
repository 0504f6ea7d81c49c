"""Fixtures of the real-agent tier: the agent CLIs (``bench/agents/install.sh``) driven through
prefixgate against simulated ranks in scripted-tool mode (``bench/agents``).

Every test here carries the ``agents`` marker (deselected by default); run them with
``bench/agents/test.sh``, which installs the CLIs first. The scenarios run once per session (about
a minute) and every test checks one of issue 20's "Done when" figures on their results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.agents import clis
from bench.agents.scenarios import SCENARIOS
from tests.helpers.markers import mark_folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).parent, pytest.mark.agents)


@pytest.fixture(scope="session")
def tier(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario's results (``bench.agents.scenarios``)."""
    missing = clis.installed()
    if missing:
        pytest.fail(f"agent CLIs not installed ({', '.join(missing)}): run bench/agents/install.sh")
    root = tmp_path_factory.mktemp("agents")
    return {name: scenario(root / name) for name, scenario in SCENARIOS.items()}
