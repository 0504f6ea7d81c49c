"""Fixtures of the real-agent tier: the agent CLIs (``tests/agents/install.sh``) driven through
prefixgate against simulated ranks in scripted-tool mode (``tests/agents``).

Every test here carries the ``agents`` marker (deselected by default); run them with
``tests/agents/test.sh``, which installs the CLIs first. The scenarios run once per session (about
a minute) and every test checks one of issue 20's "Done when" figures on their results.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.agents import clis
from tests.agents.scenarios import SCENARIOS
from tests.helpers.markers import mark_folder


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mark_folder(items, Path(__file__).parent, pytest.mark.agents)


@pytest.fixture(scope="session")
def tier(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every scenario's results (``tests.agents.scenarios``)."""
    missing = clis.installed()
    if missing:
        pytest.fail(f"agent CLIs not installed ({', '.join(missing)}): run tests/agents/install.sh")
    root = tmp_path_factory.mktemp("agents")
    return {name: scenario(root / name) for name, scenario in SCENARIOS.items()}
