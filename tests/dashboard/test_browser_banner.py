"""The browser test's skip banner names what installs the missing part (issue 49: it promised pip
playwright from a script that only runs apt-get)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.dashboard import test_browser

SCRIPT = Path(__file__).with_name("install_browser.sh")


def skipped_banner(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.delenv("CI", raising=False)  # locally: a loud skip, not a failure
    with pytest.raises(pytest.skip.Exception) as skipped:
        test_browser._playwright()
    return str(skipped.value)


def test_missing_chromium_points_at_the_apt_get_script(monkeypatch):
    monkeypatch.setattr(test_browser, "CHROMIUM", "/nonexistent/chromium")
    banner = skipped_banner(monkeypatch)
    assert "/nonexistent/chromium is not installed" in banner
    assert "bash tests/dashboard/install_browser.sh" in banner and "pip" not in banner
    # and the script does what the banner says: apt-get, nothing from pip or Playwright
    script = SCRIPT.read_text()
    assert "apt-get install -y -q chromium" in script and "pip " not in script


def test_missing_package_points_at_the_test_extra(monkeypatch):
    monkeypatch.setattr(test_browser, "CHROMIUM", sys.executable)  # a file that exists
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # import fails
    banner = skipped_banner(monkeypatch)
    assert "'playwright' is not installed" in banner
    assert "pip install -e '.[test]'" in banner and "install_browser.sh" not in banner
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"playwright>=' in pyproject.split("test = [", 1)[1].split("]", 1)[0]
