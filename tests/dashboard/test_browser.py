"""End to end in a real browser: Debian's chromium, driven by Playwright, against prefixgate + sim ranks.

Chromium comes from ``tests/dashboard/install_browser.sh`` (apt-get), never from Playwright's download.
Without it the test fails in CI (``CI=true``) and skips locally, loudly either way.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.dashboard.conftest import SYSTEM, converse

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
OUTPUT = Path(__file__).resolve().parents[2] / "test-output"
TOKEN = "dashboard-admin-token"


def _browser_missing(reason: str) -> None:
    message = (
        f"\n{'!' * 78}\n!!! DASHBOARD BROWSER TEST NOT RUN: {reason}\n"
        f"!!! install it with: bash tests/dashboard/install_browser.sh (Debian chromium + pip playwright)\n"
        f"{'!' * 78}\n"
    )
    print(message, file=sys.stderr)
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message)
    pytest.skip(message)


def _traffic(url: str, headers: dict[str, str]) -> None:
    """Three sessions, one of them breaking its prefix by editing its system prompt at turn 3."""
    converse(url, "agent-alpha", 5, headers)
    time.sleep(0.3)  # a few sample intervals apart: the hit-rate series gets several points
    converse(url, "agent-beta", 4, headers, system="You review pull requests. " * 40)
    time.sleep(0.3)
    converse(url, "agent-gamma", 3, headers)
    edited = SYSTEM.replace("edit files", "edit and test files", 1)
    converse(url, "agent-gamma", 5, headers, system=edited)
    time.sleep(0.3)


def test_dashboard_in_chromium(deployment):
    if not Path(CHROMIUM).exists():
        _browser_missing(f"{CHROMIUM} is not installed")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _browser_missing("the python package 'playwright' is not installed")

    dep = deployment(2, admin_token=TOKEN)
    dep.gateway.dashboard.recorder.series.interval = 0.1
    auth = {"Authorization": f"Bearer {TOKEN}"}
    assert httpx.get(dep.url + "/dashboard", trust_env=False).status_code == 401
    assert httpx.get(dep.url + "/admin/overview", trust_env=False).status_code == 401
    _traffic(dep.url, {})

    requests: list[str] = []
    errors: list[str] = []
    OUTPUT.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, timeout=30_000)
        try:
            context = browser.new_context(viewport={"width": 1400, "height": 1000}, extra_http_headers=auth)
            page = context.new_page()
            page.set_default_timeout(15_000)
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(dep.url + "/dashboard")

            # the hit-rate chart has points, and the figures are filled
            page.wait_for_function("Number(document.getElementById('hitchart').dataset.points) >= 3")
            assert page.inner_text("#kpi-window").endswith("%")
            assert page.inner_text("#kpi-sessions") == "3"
            assert page.locator("#ranks .rank").count() == 2

            # a session row appears and opens its turn-by-turn detail
            row = page.locator('tr.session-row[data-key="agent-gamma"]')
            row.wait_for()
            assert "system_edited" in row.inner_text()
            row.click()
            page.wait_for_selector('#session-detail[data-key="agent-gamma"]:not([hidden])')
            assert page.locator("#detail-turns .turn").count() == 8
            assert page.locator("#detail-turns .turn.break").count() >= 1
            assert "system_edited" in page.inner_text("#detail-breaks")
            # the page keeps polling: new traffic shows up without a reload
            converse(dep.url, "agent-delta", 2)
            page.wait_for_selector('tr.session-row[data-key="agent-delta"]')
            page.screenshot(path=str(OUTPUT / "dashboard.png"), full_page=True)
        finally:
            browser.close()

    assert not errors, errors
    # nothing but prefixgate itself was asked for anything
    assert requests and all(u.startswith(dep.url + "/") for u in requests), requests
